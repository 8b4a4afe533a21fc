"""The Markdown docs stay true: every Python example runs, every relative link resolves.

* Every ```python block of README.md, CONTRIBUTING.md and docs/**/*.md runs as a script on each rank of a
  pool of 2 gloo rank processes, as ``torchrun --nproc-per-node 2 example.py`` would run it (the pool's
  default process group is already up, so ``fastmesh.init_mesh(tp=2)`` reuses it). A block that must not
  run says so, with the reason, in an HTML comment on the line before its fence::

      <!-- not run: needs a CUDA GPU -->
      ```python

  Any other ``<!-- run ... -->`` / ``<!-- not run ... -->`` comment, a marker that is not followed by a
  Python fence, or one without a reason fails :func:`test_markers`.
* Links: a relative link must name a file of the repository; a link to a Markdown heading (``#anchor``, or
  ``page.md#anchor``) must name one of that page's headings, spelled as GitHub makes anchors.
* The README's two install commands are the ones ``.ci/run`` runs, and docs/architecture.md names every module.

Blocks run in a pool of their own (not the suite's shared pools), so that what an example changes in a rank
(installed compile passes, compiled code, the environment) cannot reach other tests; between blocks the
environment, logging's levels and handlers, the intra-op thread count, fastmesh's fusion pass and report, and
dynamo's caches are reset.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re

import pytest
import rank_pool
from environment import environment

REPO = pathlib.Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
BLOCK_TIMEOUT_S = 180.0
PYTHON_TAGS = ("python", "py", "python3")

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<info>[^`\s]*)")
_MARKER = re.compile(r"^\s*<!--\s*(not run|run)\b.*-->\s*$")  # what looks like a marker
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->\s*$")
# [text](target) and ![alt](target); the text may hold one level of brackets.
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def doc_pages() -> list[pathlib.Path]:
    """The Markdown files whose examples and links are checked."""
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [page for page in pages if page.is_file()]


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # 1-based line of the block's first code line
    source: str
    not_run: str | None  # the reason, for a block marked not run


@dataclasses.dataclass(frozen=True)
class Marker:
    page: str
    line: int
    text: str
    precedes_python: bool


def _scan(page: pathlib.Path) -> tuple[list[Block], list[Marker], list[tuple[int, str]]]:
    """Python blocks, markers, and the lines outside fences (line number, text) of one page."""
    lines = page.read_text().splitlines()
    name = str(page.relative_to(REPO))
    blocks, markers, prose = [], [], []
    i = 0
    while i < len(lines):
        line = lines[i]
        opening = _FENCE.match(line)
        if opening is None:
            if _MARKER.match(line):
                following = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
                is_python = following is not None and following["info"].lower() in PYTHON_TAGS
                markers.append(Marker(name, i + 1, line.strip(), is_python))
            prose.append((i + 1, line))
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence[0] * len(fence)):
            end += 1
        if opening["info"].lower() in PYTHON_TAGS:
            body = "\n".join(text[indent:] if text[:indent].isspace() else text for text in lines[i + 1 : end])
            marker = _NOT_RUN.match(lines[i - 1]) if i > 0 else None
            blocks.append(Block(name, i + 2, body + "\n", marker["reason"] if marker else None))
        i = end + 1
    return blocks, markers, prose


def _all_blocks() -> list[Block]:
    return [block for page in doc_pages() for block in _scan(page)[0]]


def _block_params() -> list:
    return [
        pytest.param(
            block,
            id=f"{block.page}:{block.line}",
            marks=[pytest.mark.skip(reason=f"marked not run: {block.not_run}")] if block.not_run else [],
        )
        for block in _all_blocks()
    ]


def run_block(source: str, page: str, line: int) -> None:
    """On a rank: run one example as a script, then undo what it may have changed in this process."""
    import torch._dynamo

    import fastmesh.compile

    saved_environ = dict(os.environ)
    saved_threads = torch.get_num_threads()
    saved_root = logging.root.level, list(logging.root.handlers)
    saved_levels = {
        name: logger.level
        for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    # Blank lines in front keep the page's line numbers in tracebacks.
    code = compile("\n" * (line - 1) + source, str(REPO / page), "exec")
    try:
        exec(code, {"__name__": "__main__", "__file__": str(REPO / page)})
    finally:
        os.environ.clear()
        os.environ.update(saved_environ)
        torch.set_num_threads(saved_threads)
        logging.root.setLevel(saved_root[0])
        logging.root.handlers[:] = saved_root[1]
        for name, logger in logging.Logger.manager.loggerDict.items():
            if isinstance(logger, logging.Logger):
                logger.setLevel(saved_levels.get(name, logging.NOTSET))
        if fastmesh.compile.fusion_enabled():
            fastmesh.compile.disable_fusion()
        fastmesh.compile.fusion_report(reset=True)
        torch._dynamo.reset()


def _started() -> None:
    pass


@pytest.fixture(scope="module")
def docs_pool():
    pool = rank_pool.RankPool(WORLD_SIZE)
    # gloo even where GPUs exist: the examples are CPU examples (their text says how to move them to GPUs).
    with environment(FASTMESH_TEST_BACKEND="gloo"):
        pool.run(_started)  # starts the ranks under this backend
    yield pool
    pool.close()


@pytest.mark.parametrize("block", _block_params())
def test_example(block: Block, docs_pool):
    docs_pool.run(run_block, {"source": block.source, "page": block.page, "line": block.line}, timeout=BLOCK_TIMEOUT_S)


def test_markers():
    problems = []
    for page in doc_pages():
        for marker in _scan(page)[1]:
            where = f"{marker.page}:{marker.line}: {marker.text}"
            if not _NOT_RUN.match(marker.text):
                problems.append(f"{where}: the only marker is `<!-- not run: REASON -->`")
            elif not marker.precedes_python:
                problems.append(f"{where}: a marker must be the line right before a ```python fence")
    assert not problems, "\n".join(problems)


def test_examples_exist():
    """The README's ops, styles and compile examples are among the blocks that run."""
    readme = [block for block in _all_blocks() if block.page == "README.md" and block.not_run is None]
    for needle in ("fastmesh.all_gather_matmul(", "FusedColwiseParallel(", "fastmesh.compile.enable_fusion("):
        assert any(needle in block.source for block in readme), f"no README example that runs calls {needle}"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    anchors, seen = set(), {}
    for _, text in _scan(page)[2]:
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", text)
        if heading:
            anchor = github_anchor(heading[1])
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def test_relative_links():
    problems = []
    for page in doc_pages():
        for number, text in _scan(page)[2]:
            text = re.sub(r"`[^`]*`", "", text)  # code spans are not links
            for match in _LINK.finditer(text):
                target = match["target"]
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                resolved = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO)}:{number}: {target}"
                if not resolved.exists():
                    problems.append(f"{where}: no such file")
                elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                    problems.append(f"{where}: no heading with that anchor in {resolved.relative_to(REPO)}")
    assert not problems, "\n".join(problems)


def test_install_commands_are_the_ci_commands():
    """.ci/run runs the README's two commands ("Install and run"), character for character."""
    ci = (REPO / ".ci" / "run").read_text()
    commands = re.findall(r"^phase (?:install-and-bench|tests) bash -c '(.*)'$", ci, re.MULTILINE)
    assert len(commands) == 2, ".ci/run no longer has the phases install-and-bench and tests"
    readme = (REPO / "README.md").read_text().splitlines()
    for command in commands:
        assert command in readme, f"README.md lacks the line .ci/run runs: {command}"


def test_architecture_names_every_module():
    """docs/architecture.md's file map names every Python module of the package, the kernels and the benchmarks."""
    page = (REPO / "docs" / "architecture.md").read_text()
    modules = [
        path
        for pattern in ("fastmesh/**/*.py", "kernels/*.py", "bench/*.py")
        for path in sorted(REPO.glob(pattern))
        if path.name != "__init__.py"
    ]
    missing = [str(path.relative_to(REPO)) for path in modules if path.name not in page]
    assert not missing, f"docs/architecture.md does not mention: {missing}"
