#!/usr/bin/env python3
"""Checks the book's sources and the README without building them:

- every link to a file resolves, and every #anchor names a heading of
  its page (anchors made as mdBook makes them);
- no page of the book links to a file outside docs/src: the built HTML
  holds only the book (reference/files.md includes the repository's
  files the pages refer to);
- every page under docs/src is in SUMMARY.md, every SUMMARY entry exists,
  and its title is its page's heading;
- the module map (concepts/architecture.md) names every top-level module
  of host/src (each `pub mod` in lib.rs, as `name/` or `name.rs`).

Prints each problem and exits 1 when there is one.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "docs", "src")
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchor(text):
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return "".join(c if (c.isalnum() or c in "-_") else "-" if c == " " else "" for c in text)


def outside_code(text, inline=True):
    """The text with fenced code blocks (and inline code, if `inline`) blanked out."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "``", line) if inline else line)
    return "\n".join(out)


def anchors_of(path, cache={}):
    if path not in cache:
        seen, found = {}, set()
        # A heading's inline code is part of its anchor.
        for line in outside_code(open(path, encoding="utf-8").read(), inline=False).split("\n"):
            m = re.match(r"^#{1,6} (.*)", line)
            if m:
                a = anchor(m.group(1))
                n = seen.get(a, 0)
                seen[a] = n + 1
                found.add(a if n == 0 else f"{a}-{n}")
        cache[path] = found
    return cache[path]


def check_links(path, problems):
    text = outside_code(open(path, encoding="utf-8").read())
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, frag = target.partition("#")
        dest = path if file == "" else os.path.normpath(os.path.join(os.path.dirname(path), file))
        where = os.path.relpath(path, ROOT)
        if not os.path.exists(dest):
            problems.append(f"{where}: link to {target}: no such file")
            continue
        if path.startswith(SRC) and not dest.startswith(SRC + os.sep):
            problems.append(f"{where}: link to {target}: outside the book (include it in reference/files.md)")
            continue
        if frag and dest.endswith(".md") and frag not in anchors_of(dest):
            problems.append(f"{where}: link to {target}: no heading #{frag} there")


def check_includes(path, problems):
    """Every {{#include FILE}} names a file that exists."""
    for target in re.findall(r"\{\{#include ([^}:]+)", open(path, encoding="utf-8").read()):
        if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), target.strip()))):
            problems.append(f"{os.path.relpath(path, ROOT)}: include of {target}: no such file")


def main():
    problems = []
    pages = []
    for dirpath, _, files in os.walk(SRC):
        pages += [os.path.join(dirpath, f) for f in files if f.endswith(".md")]
    for page in pages + [os.path.join(ROOT, "README.md")]:
        check_links(page, problems)
    for page in pages:
        check_includes(page, problems)

    summary = open(os.path.join(SRC, "SUMMARY.md"), encoding="utf-8").read()
    listed = {os.path.normpath(os.path.join(SRC, t)) for t in re.findall(r"\]\(([^)]+\.md)\)", summary)}
    for page in pages:
        if page not in listed and not page.endswith("SUMMARY.md"):
            problems.append(f"{os.path.relpath(page, ROOT)}: not in SUMMARY.md")
    # A reader who follows the table of contents lands on the page it names.
    for title, target in re.findall(r"\[([^\]]+)\]\(([^)]+\.md)\)", summary):
        path = os.path.join(SRC, target)
        if os.path.exists(path):
            heading = next((l[2:].strip() for l in open(path, encoding="utf-8") if l.startswith("# ")), "")
            if heading.replace("`", "") != title:
                problems.append(f"docs/src/SUMMARY.md: {title!r} is headed {heading!r} on {target}")

    lib = open(os.path.join(ROOT, "host", "src", "lib.rs"), encoding="utf-8").read()
    modules = re.findall(r"^pub mod (\w+);", lib, re.M)
    arch = open(os.path.join(SRC, "concepts", "architecture.md"), encoding="utf-8").read()
    for module in modules:
        if f"`{module}/" not in arch and f"`{module}.rs" not in arch and f" {module}.rs" not in arch:
            problems.append(f"docs/src/concepts/architecture.md: the module map does not name host/src/{module}")

    for problem in problems:
        print(problem)
    if problems:
        print(f"docs-check: {len(problems)} problem(s)")
        return 1
    print(f"docs-check: {len(pages)} pages, links, SUMMARY and module map ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
