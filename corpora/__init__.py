"""Passage corpora and QA datasets: formats, loaders, preparation and the shipped sample."""

from corpora.formats import Passage, QAExample, read_corpus, write_jsonl
from corpora.qa import read_qa
from corpora.sample import SAMPLE_DIR, sample_paths

__all__ = ["SAMPLE_DIR", "Passage", "QAExample", "read_corpus", "read_qa", "sample_paths", "write_jsonl"]
