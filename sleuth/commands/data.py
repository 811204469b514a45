"""``sleuth data``: the public data sets (the seven benchmarks, Search-R1's training set, the wiki-18 corpus and
its e5 index): ``list`` says where each comes from, its licence and size, and whether the data dir holds it;
``get`` downloads them from the Hugging Face Hub and converts them (:mod:`corpora.fetch`)."""

from __future__ import annotations

import argparse
import sys

HELP = "list the public data sets (benchmarks, training set, wiki-18, e5 index) or fetch them from the hub"

EPILOG = """examples:
  sleuth data list
  sleuth data get benchmarks                 # the seven test sets sleuth eval --benchmarks all reads
  sleuth data get nq_hotpotqa_train wiki18   # Search-R1's training questions and its corpus
data dir: --data-dir, else $SLEUTH_DATA_DIR (e.g. an offline mirror), else sleuth/data under the user's cache
directory (~/.cache/sleuth/data on Linux). An interrupted download resumes when the same command runs again;
HF_ENDPOINT points at another hub, HF_HUB_OFFLINE=1 forbids downloading."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from corpora.catalog import DATASETS, GROUPS

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    ls = sub.add_parser("list", help="each data set: source, licence, size, and whether the data dir holds it",
                        allow_abbrev=False)
    get = sub.add_parser("get", help="download data sets from the hub and convert them", allow_abbrev=False)
    get.add_argument("names", nargs="+", metavar="NAME",
                     help=f"data sets ({', '.join(DATASETS)}) or groups ({', '.join(GROUPS)})")
    get.add_argument("--revision", help="hub revision (commit, tag or branch) to fetch instead of the pinned "
                     "one; the named sets must share one repository")
    get.add_argument("--force", action="store_true", help="download and convert again even when present")
    get.add_argument("--keep-downloads", action="store_true",
                     help="keep the downloaded corpus and index parts after converting them (default: deleted)")
    for q in (ls, get):
        q.add_argument("--data-dir", help="folder of the data sets (default: $SLEUTH_DATA_DIR, else "
                       "sleuth/data under the user's cache directory)")


def run(args: argparse.Namespace) -> int:
    return _list(args) if args.action == "list" else _get(args)


def _list(args: argparse.Namespace) -> int:
    from corpora.catalog import DATASETS, resolve_data_dir, status

    root = resolve_data_dir(args.data_dir)
    rows = [("name", "source (revision)", "licence", "size", "in the data dir")]
    for ds in DATASETS.values():
        st = status(ds, root)
        if st.present:
            where = ", ".join(str(f.relative_to(root)) for f in st.files)
            commit = (st.manifest or {}).get("commit")
            here = f"yes: {where} ({_bytes(st.bytes)}" + (f", commit {commit[:10]})" if commit else ")")
        else:
            here = f"no: {_bytes(st.partial)} of a download kept" if st.partial else "no"
        rows.append((ds.name, f"{ds.repo} ({ds.revision[:10]})", ds.licence, ds.size, here))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    print(f"\ndata dir: {root}\nfetch with: sleuth data get NAME... (groups: benchmarks, all)")
    return 0


def _get(args: argparse.Namespace) -> int:
    from corpora.catalog import expand_names, get_dataset
    from corpora.fetch import get

    names = expand_names(args.names)
    repos = {get_dataset(n).repo for n in names}
    if args.revision and len(repos) > 1:
        raise ValueError(f"--revision names one revision of one repository; these sets come from {len(repos)} "
                         f"({', '.join(sorted(repos))}): fetch them in separate commands")
    for name in names:  # the steps on stderr (with the progress bars), the result on stdout
        done = get(name, args.data_dir, revision=args.revision, force=args.force,
                   keep_downloads=args.keep_downloads, log=lambda s: print(s, file=sys.stderr, flush=True))
        state = "fetched" if done["fetched"] else "present"
        commit = f" (commit {done['commit'][:10]})" if done.get("commit") else ""
        print(f"{name}: {state}{commit}: {', '.join(done['files'])}")
    return 0


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"
