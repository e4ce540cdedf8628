"""Every example in the docs runs: the config snippets check, and the commands that start things are run by a test
or say why they cannot run here.

The blocks of ``docs/**/*.md`` and ``README.md`` (docs/development.md, "Examples in the docs"):

- a ```` ```yaml ```` block is an llmgw config and passes ``llmgw config check`` (every section is optional, so
  a fragment of top-level sections is checked as it is; ``${VAR}`` gets a value), unless the HTML comment on the
  line before it says otherwise: ``<!-- config check: fails -->`` (an example of errors: it must fail, and print
  what a ``$ llmgw config check FILE`` console block right after it shows),
  ``<!-- config check: with test TLS files -->`` (its ``.pem`` and ``.key`` paths become a test CA, certificate
  and key) or ``<!-- config check: skip, WHY -->`` (not an llmgw config, or one that needs what is not here);
- a block in another language that begins like a config (``listen:``, ``models:``...) must be tagged ``yaml``;
- a shell block (``bash``, ``sh``, ``shell``, ``console`` or untagged) with a command that starts something
  (``llmgw serve``, ``agent`` or ``sim``, ``./dev serve``, ``vllm serve``, ``podman run``, ``systemctl``,
  ``kubectl apply``, ``redis-server``) carries ``<!-- runs: tests/PATH.py::test_name -->``, a test that does
  what it shows (the test must exist), or ``<!-- not runnable here: WHY -->``. Output and process listings are
  tagged ``text``. ``llmgw bench`` commands are records of measurements, not examples, and are not held to it.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from llmgw import cli

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARKER = re.compile(r"<!--\s*(config check|runs|not runnable here):\s*(.*?)\s*-->")
TOP_LEVEL_KEY = re.compile(r"(listen|control_listen|models|api_keys|admin_tokens|agents|profiles|deployments|state|"
                           r"limits|health|teams|prices|tenancy|flow|metrics|upstream_tls|data_tls|control_tls):")
STARTS = re.compile(r"(\./dev serve|llmgw (serve|agent|sim)|\S*python\S* -m llmgw (serve|agent|sim)|PYTHON -m llmgw "
                    r"sim|vllm serve|(podman|docker) run|systemctl|kubectl apply|redis-server)(\s|$)")
SHELL = {"bash", "sh", "shell", "console", ""}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str  # without the fence's indentation
    marker: tuple[str, str] | None  # ("config check", "fails"), from the HTML comment on the line before

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks_of(page: Path, text: str) -> list[Block]:
    lines, found, index = text.splitlines(), [], 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        indent, body, end = len(fence[1]), [], index + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            body.append(lines[end][indent:])
            end += 1
        marker = MARKER.fullmatch(lines[index - 1].strip()) if index else None
        said = (marker[1], marker[2]) if marker else None
        found.append(Block(page, index + 1, fence[2], "\n".join(body) + "\n", said))
        index = end + 1
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page, page.read_text())]
CONFIGS = [block for block in BLOCKS if block.language == "yaml"]


def check_config(text: str, path: Path) -> tuple[int, str]:
    path.write_text(text)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(["config", "check", str(path)])
    return code, out.getvalue()


def with_test_tls_files(text: str, folder: Path) -> str:
    """Each ``.pem``/``.key`` path replaced by a test file: a CA for a name with ``ca`` in it, a key for ``.key``,
    else the certificate chain (of ``localhost``, signed by that CA)."""
    ca = trustme.CA()
    leaf = ca.issue_cert("localhost")
    files = {"ca": folder / "ca.pem", "key": folder / "leaf.key", "chain": folder / "leaf.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    leaf.private_key_pem.write_to_path(str(files["key"]))
    leaf.cert_chain_pems[0].write_to_path(str(files["chain"]))

    def test_file(match: re.Match[str]) -> str:
        name = match[0].rsplit("/", 1)[-1]
        kind = "key" if name.endswith(".key") else "ca" if "ca" in name.split(".")[0].split("-") else "chain"
        return str(files[kind])

    return re.sub(r"/[\w./-]+\.(pem|key)\b", test_file, text)


@pytest.mark.parametrize("block", CONFIGS, ids=lambda block: block.where)
def test_every_config_example_checks(block, tmp_path, monkeypatch):
    kind, why = block.marker if block.marker and block.marker[0] == "config check" else ("", "")
    if why.startswith("skip"):
        assert why.removeprefix("skip").strip(" ,:"), f"{block.where}: say why it is skipped"
        return
    for name in re.findall(r"\$\{(\w+)\}", block.text):
        monkeypatch.setenv(name, "x" * 40)
    text = with_test_tls_files(block.text, tmp_path) if why == "with test TLS files" else block.text
    assert why in ("", "fails", "with test TLS files"), f"{block.where}: unknown config check marker {why!r}"
    code, out = check_config(text, tmp_path / "example.yaml")
    if why == "fails":
        assert code == 1, f"{block.where}: the example of errors checks clean:\n{out}"
        shown = documented_output(block)
        if shown is not None:  # the errors the page shows are the ones the command prints
            name, lines = shown
            assert out.replace(str(tmp_path / "example.yaml"), name).splitlines() == lines, block.where
    else:
        assert code == 0, f"{block.where}: `llmgw config check` fails on it:\n{out}"


def documented_output(block: Block) -> tuple[str, list[str]] | None:
    """(FILE, the lines shown) when the block after ``block`` is ``$ llmgw config check FILE`` and its output."""
    following = BLOCKS[BLOCKS.index(block) + 1] if BLOCKS.index(block) + 1 < len(BLOCKS) else None
    if following is None or following.page != block.page or following.language != "console":
        return None
    command, *lines = following.text.splitlines()
    checked = re.fullmatch(r"\$ llmgw config check (\S+)", command)
    return (checked[1], lines) if checked else None


def config_tag_problems(blocks: list[Block]) -> list[str]:
    problems = []
    for block in blocks:
        first = next((line for line in block.text.splitlines() if line.strip() and not line.startswith("#")), "")
        if block.language != "yaml" and TOP_LEVEL_KEY.match(first):
            problems.append(f"{block.where}: a config in a block tagged {block.language!r}: tag it yaml")
    return problems


def start_problems(blocks: list[Block]) -> list[str]:
    problems = []
    for block in blocks:
        commands = [re.sub(r"^(\$\s+)?(\w+=\S+\s+)*", "", line.strip()) for line in block.text.splitlines()]
        if block.language not in SHELL or not any(STARTS.match(command) for command in commands):
            continue
        kind, what = block.marker or ("", "")
        if kind == "not runnable here" and what:
            continue
        if kind == "runs":
            file, _, name = what.partition("::")
            source = REPO / file
            if source.is_file() and re.search(rf"def {re.escape(name)}\(", source.read_text()):
                continue
            problems.append(f"{block.where}: no test {what!r}")
            continue
        problems.append(f"{block.where}: starts something: put <!-- runs: tests/PATH.py::test_name --> or "
                        f"<!-- not runnable here: WHY --> on the line before it")
    return problems


def test_every_config_block_is_tagged_yaml():
    assert config_tag_problems(BLOCKS) == []


def test_every_command_that_starts_something_is_run_by_a_test_or_says_why_not():
    assert start_problems(BLOCKS) == []


# -- the checks catch what they are for ---------------------------------------------------------------------------


def test_markers_and_missing_ones_are_read_from_the_line_before_a_block():
    page = REPO / "docs" / "example.md"
    text = ("<!-- runs: tests/unit/test_docs_examples.py::test_markers_and_missing_ones_are_read_from_the_line_before"
            "_a_block -->\n```bash\n./dev serve\n```\n\n```console\n$ FOO=1 llmgw sim --port 0\n```\n"
            "<!-- runs: tests/unit/test_docs_examples.py::test_gone -->\n```\nllmgw agent --join URL\n```\n"
            "<!-- not runnable here: needs a GPU -->\n```sh\nvllm serve /models/x\n```\n"
            "```text\nllmgw serve --workers 3   the supervisor\n```\n```bash\nllmgw bench routing --quick\n```\n"
            "```\nlisten: 127.0.0.1:8000\n```\n<!-- config check: fails -->\n```yaml\nlisten: nowhere\n```\n")
    blocks = blocks_of(page, text)
    assert [block.marker for block in blocks][-1] == ("config check", "fails")
    assert start_problems(blocks) == [
        "docs/example.md:6: starts something: put <!-- runs: tests/PATH.py::test_name --> or "
        "<!-- not runnable here: WHY --> on the line before it",
        "docs/example.md:10: no test 'tests/unit/test_docs_examples.py::test_gone'"]
    assert config_tag_problems(blocks) == ["docs/example.md:23: a config in a block tagged '': tag it yaml"]


def test_a_config_that_does_not_check_is_told_apart(tmp_path):
    assert check_config("listen: 127.0.0.1:8000\n", tmp_path / "ok.yaml")[0] == 0
    code, out = check_config("models:\n  - name: tiny\n    rplicas: []\n", tmp_path / "bad.yaml")
    assert code == 1 and "rplicas: unknown key" in out
    tls = with_test_tls_files("data_tls:\n  cert_file: /etc/llmgw/tls/gateway.pem\n  key_file: /etc/x/gateway.key\n"
                              "upstream_tls:\n  ca_file: /etc/llmgw/tls/cluster-ca.pem\n", tmp_path)
    assert check_config(tls, tmp_path / "tls.yaml")[0] == 0
    assert "leaf.pem" in tls and "leaf.key" in tls and "ca.pem" in tls
