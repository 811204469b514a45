#!/usr/bin/env bash
# Fetch (on a machine that reaches PyPI) the wheels bench/gpu_check.sh installs on a GPU machine whose image has
# torch, transformers, tokenizers, numpy, numba, pytest, ... but not Sleuth's other dependencies: the packages
# below are what the check imports beyond such an image (LangGraph, pydantic, FastAPI/uvicorn, bm25s, faiss-cpu,
# ...) plus Liger-Kernel for the kernel benchmark's Liger column. Wheels for CPython $GPU_PYTHON_VERSION (3.12) on
# manylinux x86_64, each at the version this checkout's Python ($PYTHON, default .venv/bin/python) has, into .whl/
# (git-ignored; about 32 MB). Carry .whl/ with the checkout; bench/gpu_check.sh installs it first.
# faiss-gpu is not among them: its wheel (135 MB) and the CUDA 12 runtime wheels it needs are too large to carry,
# so on such a machine the faiss part compares the CPU fallback and reports it skipped.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PYV=${GPU_PYTHON_VERSION:-3.12}
NAMES="annotated-types bm25s dill distro email-validator faiss-cpu fastapi httpcore2 httpx2 jsonpatch jsonpointer
langchain-core langchain-protocol langgraph langgraph-checkpoint langgraph-prebuilt langgraph-sdk langsmith
opentelemetry-api orjson ormsgpack PyStemmer pydantic pydantic_core python-multipart requests-toolbelt sniffio
starlette tenacity truststore typing-inspection uuid_utils uvicorn watchfiles websockets zstandard"
pins="liger-kernel==0.8.5"
for n in $NAMES; do
  v=$("$PY" -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p')
  pins="$pins $n${v:+==$v}"
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
echo "$(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
