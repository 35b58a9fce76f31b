#!/usr/bin/env python3
"""Turns GCIDE's dictd files into moka's record format (records separated by lines of one '%').

usage: gcide_records.py GCIDE.index GCIDE.dict[.dz] OUT

One record per dictionary entry, in file order; entries the index names more than once are
written once. Kept: the headword, part of speech, etymology, numbered senses and the
quotations from literature. Dropped: the dictd header entries (00-database-*), the
pronunciation markup between backslashes (\\Af*fat"u*ate\\), the curly braces of
cross-references ({Fact} -> Fact) and the lines that only name a source ([1913 Webster],
[PJC], [WordNet 1.5]). The .dict.dz is dictzip, which gzip reads.
"""
import gzip
import re
import sys

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def b64_number(text):
    value = 0
    for ch in text:
        value = value * 64 + B64.index(ch)
    return value


SOURCE_LINE = re.compile(r"^\s*\[[^\]\n]*\]\s*$")
PRONUNCIATION = re.compile(r"\\[^\\\n]*\\,?")
BRACES = re.compile(r"[{}]")


def clean(entry):
    lines = []
    for line in entry.splitlines():
        if SOURCE_LINE.match(line):
            continue
        line = BRACES.sub("", PRONUNCIATION.sub("", line)).rstrip()
        if line.strip() == "%":  # would end the record early
            line = line.replace("%", "%%")
        lines.append(line)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    index_path, dict_path, out_path = sys.argv[1:]
    opener = gzip.open if dict_path.endswith(".dz") or dict_path.endswith(".gz") else open
    with opener(dict_path, "rb") as f:
        data = f.read()
    seen = set()
    records = 0
    with open(index_path, encoding="utf-8") as index, open(out_path, "w", encoding="utf-8") as out:
        for line in index:
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 3:
                sys.exit(f"gcide_records.py: {index_path}: malformed index line {line!r}")
            headword, offset, length = fields[0], b64_number(fields[1]), b64_number(fields[2])
            if headword.startswith("00-database") or headword.startswith("00database") or offset in seen:
                continue
            seen.add(offset)
            if offset + length > len(data):
                sys.exit(f"gcide_records.py: {index_path}: entry {headword!r} ends past the end of {dict_path}")
            text = clean(data[offset:offset + length].decode("utf-8", errors="replace"))
            if text:
                out.write(text + "\n%\n")
                records += 1
    if records == 0:
        sys.exit(f"gcide_records.py: no entries in {dict_path}")
    print(f"gcide_records.py: {records} entries -> {out_path}")


if __name__ == "__main__":
    main()
