"""The docs against the code: every command in a fenced bash block of README.md and docs/*.md names a module,
script, flag, make target or route that exists, every relative link lands on a file and heading, and the
README stays short."""
import functools
import importlib.util
import itertools
import re
import shlex
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from service_process import ROOT
from starlette.routing import Match

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTIONS = {">", ">>", "<", "2>", "&>"}
# curl options whose next word is their value, never the URL (--url's value is the URL, handled on its own)
CURL_VALUES = {"-F", "--form", "-d", "--data", "--data-binary", "--data-raw", "--data-urlencode", "--json", "-H",
               "--header", "-o", "--output", "-X", "--request", "-u", "--user", "-A", "--user-agent", "-e",
               "--referer", "-b", "--cookie", "-c", "--cookie-jar", "-w", "--write-out", "-m", "--max-time",
               "--connect-timeout", "-T", "--upload-file", "--retry", "-K", "--config"}
CURL_BODIES = {"-F", "--form", "-d", "--data", "--data-binary", "--data-raw", "--data-urlencode", "--json"}


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    argv: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def split_fenced(text: str) -> tuple[list[tuple[str, int, list[str]]], list[tuple[int, str]]]:
    """(language, number of the first line, lines) of each fenced code block, and the numbered lines outside."""
    blocks, outside, fence = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(1)
            blocks.append((opened.group(2).lower(), number + 1, []))
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
        elif fence is not None:
            blocks[-1][2].append(line)
        else:
            outside.append((number, line))
    return blocks, outside


def without_comment(line: str) -> str:
    """The line up to a `#` that starts a word outside quotes (shlex's own comments also cut `a#b`)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def logical_lines(lines: list[str], first: int) -> list[tuple[int, str]]:
    """Lines continued with a trailing backslash joined, each with the number of its first line."""
    joined, start, parts = [], None, []
    for number, line in enumerate(lines, first):
        start = number if start is None else start
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        joined.append((start, " ".join(parts + [line])))
        start, parts = None, []
    return joined


def expand(line: str, variables: dict[str, str]) -> str:
    """$NAME and ${NAME} of the variables set earlier in the block; others ($PWD) stay as written."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), line)


def commands_of(page: Path) -> list[Command]:
    found = []
    for language, first, lines in split_fenced(page.read_text())[0]:
        if language not in SHELL_BLOCKS:
            continue
        variables: dict[str, str] = {}  # RECIPE="..." lines, so that later $RECIPE flags are checked too
        for number, line in logical_lines(lines, first):
            line = without_comment(line).strip().removeprefix("$ ")
            line = expand(line, variables)
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words, segments = list(lexer), [[]]
            for word in words:
                if word in SEPARATORS:
                    segments.append([])
                else:
                    segments[-1].append(word)
            for segment in segments:
                segment = [w for i, w in enumerate(segment)  # a redirection and its file are not arguments
                           if w not in REDIRECTIONS and (i == 0 or segment[i - 1] not in REDIRECTIONS)]
                while segment and ASSIGNMENT.match(segment[0]):
                    name, value = segment.pop(0).split("=", 1)
                    variables[name] = value
                if segment:
                    found.append(Command(page, number, tuple(segment)))
    return found


def is_python(word: str) -> bool:
    return Path(word).name in ("python", "python3")


COMMANDS = [command for page in PAGES for command in commands_of(page)]
MODULES = [c for c in COMMANDS if is_python(c.argv[0]) and len(c.argv) > 2 and c.argv[1] == "-m"]
SCRIPTS = [c for c in COMMANDS if is_python(c.argv[0]) and len(c.argv) > 1 and c.argv[1].endswith(".py")]
MAKES = [c for c in COMMANDS if c.argv[0] == "make"]
CURLS = [c for c in COMMANDS if c.argv[0] == "curl"]


def ids(commands: list[Command]) -> list[str]:
    return [f"{c.where} {shlex.join(c.argv)[:80]}" for c in commands]


def test_the_docs_hold_enough_commands_to_check():
    # so that a parser that finds nothing cannot pass (the docs hold 24 module, 20 script, 10 make, 6 curl lines)
    assert len(MODULES) >= 15 and len(SCRIPTS) >= 10 and len(MAKES) >= 5 and len(CURLS) >= 4, \
        (len(MODULES), len(SCRIPTS), len(MAKES), len(CURLS))
    assert {("make", "serve"), ("make", "test")} <= {c.argv for c in MAKES if c.page.name == "README.md"}  # the two
    assert {c.argv[2] for c in MODULES} >= {"service", "service.loadtest", "export", "models.train",
                                             "models.synthetic", "service.ray_serve"}


@functools.cache
def help_text(*argv: str) -> str:
    """`python ARGV --help`, once per module or script (and subcommand)."""
    shown = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, check=False)
    assert shown.returncode == 0, f"python {' '.join(argv)} --help failed:\n{shown.stderr[-2000:]}"
    return shown.stdout


def first_positional_choices(help: str) -> tuple[set[str], bool]:
    """The choices of the first positional argument, if it has any, and whether they are subcommands."""
    listed = re.search(r"^(?:positional arguments|arguments):\n\s+\{([^}]*)\}", help, re.MULTILINE)
    if not listed:
        return set(), False
    choices = set(listed.group(1).split(","))
    return choices, bool(re.search(r"\{" + re.escape(listed.group(1)) + r"\} \.\.\.", help))


def declared(help: str) -> str:
    """The usage and the option lines of a help text: a flag its description merely mentions is not taken."""
    usage, _, rest = help.partition("\n\n")
    return "\n".join([usage, *(line for line in rest.splitlines() if re.match(r"^\s{2}-", line))])


def choice_errors(help: str, args: tuple[str, ...]) -> list[str]:
    """`--flag value` pairs whose value is none of the choices the help shows ({a,b}; nargs: [{a,b} ...])."""
    errors = []
    for i, word in enumerate(args):
        shown = re.search(rf"(?<![\w-]){re.escape(word)}\s+\{{([^}}]*)\}}(\s+\[\{{)?", help)
        if not word.startswith("--") or not shown:
            continue
        values = list(itertools.takewhile(lambda w: not w.startswith("-"), args[i + 1:]))
        errors += [f"{word} {v}" for v in (values if shown.group(2) else values[:1])
                   if v not in shown.group(1).split(",")]
    return errors


def flags(words: tuple[str, ...]) -> list[str]:
    """The --flags among the words (`[--flag` of a usage line included, `--flag=value` as `--flag`)."""
    return [m.group(1) for w in words if (m := re.match(r"^\[*(--[A-Za-z][\w-]*)", w))]


def assert_flags_accepted(command: Command, program: tuple[str, ...], args: tuple[str, ...]) -> None:
    help = help_text(*program)
    choices, subcommands = first_positional_choices(help)
    if choices and args and not args[0].startswith("-"):
        assert args[0] in choices, f"{command}: {args[0]!r} is none of {sorted(choices)}"
        if subcommands:  # a subcommand's flags are in its own help
            help = help_text(*program, args[0])
    unknown = [f for f in flags(args) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", declared(help))]
    assert not unknown, f"{command}: python {' '.join(program)} does not take {', '.join(unknown)}"
    wrong = choice_errors(declared(help), args)
    assert not wrong, f"{command}: {', '.join(wrong)}: not one of the choices python {' '.join(program)} takes"


def module_exists(module: str) -> bool:
    parts = module.split(".")
    if (ROOT.joinpath(*parts).with_suffix(".py")).is_file() or (ROOT.joinpath(*parts) / "__main__.py").is_file():
        return True
    try:  # pytest, pip
        return not (ROOT / parts[0]).exists() and importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


@pytest.mark.parametrize("command", MODULES, ids=ids(MODULES))
def test_python_modules_and_their_flags_exist(command: Command):
    module, args = command.argv[2], command.argv[3:]
    assert module_exists(module), f"{command}: no module {module} to run"
    if flags(args) or (args and not args[0].startswith("-")):
        assert_flags_accepted(command, ("-m", module), args)


@pytest.mark.parametrize("command", SCRIPTS, ids=ids(SCRIPTS))
def test_python_scripts_and_their_flags_exist(command: Command):
    script, args = ROOT / command.argv[1], command.argv[2:]
    assert script.is_file(), f"{command}: no file {command.argv[1]}"
    if flags(args):
        # --help runs a script without argparse (bench/decode_speed.py measures on any argument)
        assert "argparse" in script.read_text(), f"{command}: {command.argv[1]} takes no flags"
        assert_flags_accepted(command, (command.argv[1],), args)


def make_targets() -> set[str]:
    """Every rule's targets in the Makefile (not `VAR := value`, not targets built from variables)."""
    rules = re.findall(r"^([^\s#][^:=\n]*?)\s*:(?!=)", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    return {target for rule in rules for target in rule.split() if "$" not in target}


@pytest.mark.parametrize("command", MAKES, ids=ids(MAKES))
def test_make_targets_exist(command: Command):
    targets = [w for w in command.argv[1:] if not w.startswith("-") and not ASSIGNMENT.match(w)]  # RUNTIME=gpu
    missing = set(targets) - make_targets()
    assert not missing, f"{command}: the Makefile has no target {', '.join(sorted(missing))}"


def curl_request(argv: tuple[str, ...]) -> tuple[str, list[str]]:
    """The method curl would send and the URLs it would send it to."""
    method, urls, words = "GET", [], iter(argv[1:])
    for word in words:
        if word in ("-X", "--request"):
            method = next(words)
        elif word in CURL_BODIES:
            method = "POST" if method == "GET" else method
            next(words)
        elif word in CURL_VALUES:
            next(words)
        elif word == "--url":
            urls.append(next(words))
        elif word in ("-I", "--head"):
            method = "HEAD"
        elif not word.startswith("-"):
            urls.append(word)
    return method, urls


@functools.cache
def app_routes() -> list:
    from service.http.app import create_app  # reads the repository; the sessions open only at start-up
    return create_app().router.routes


def route_match(method: str, path: str) -> Match:
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"", "headers": []}
    return max((route.matches(scope)[0] for route in app_routes()), key=lambda match: match.value)


@pytest.mark.parametrize("command", CURLS, ids=ids(CURLS))
def test_curl_paths_are_routes_of_the_app(command: Command):
    method, urls = curl_request(command.argv)
    assert urls, f"{command}: no URL"
    for url in urls:
        path = urlsplit(url if "://" in url else f"http://{url}").path or "/"
        path = re.sub(r"<[^>/]*>", "placeholder", path)  # /v2/models/<name>/infer
        match = route_match(method, path)
        assert match != Match.NONE, f"{command}: the app has no route {path}"
        assert match == Match.FULL, f"{command}: {path} takes no {method}"


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: a link's text only, lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")


@functools.cache
def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for _, line in split_fenced(page.read_text())[1]:
        if heading := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            anchor = github_anchor(heading.group(1))
            found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")  # GitHub numbers repeats
            seen[anchor] = seen.get(anchor, 0) + 1
    return found


def relative_links(page: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in split_fenced(page.read_text())[1]:
        line = re.sub(r"`[^`]*`", "", line)  # code spans hold brackets that are not links
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                links.append((number, target))
    return links


LINKS = [(page, number, target) for page in PAGES for number, target in relative_links(page)]


def test_the_docs_hold_enough_links_to_check():
    assert len(LINKS) >= 30 and {target.split("#")[0] for _, _, target in LINKS} >= {
        "docs/api.md", "docs/serving.md", "docs/deploy.md", "docs/export.md", "docs/models.md", "docs/attention.md",
        "docs/performance.md", "docs/development.md"}


@pytest.mark.parametrize(("page", "number", "target"), LINKS,
                         ids=[f"{p.relative_to(ROOT)}:{n} {t}" for p, n, t in LINKS])
def test_relative_links_reach_a_file_and_heading(page: Path, number: int, target: str):
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.exists(), f"{page.relative_to(ROOT)}:{number}: {path} does not exist"
    if anchor:
        assert linked.suffix == ".md" and anchor in anchors(linked), \
            f"{page.relative_to(ROOT)}:{number}: {linked.relative_to(ROOT)} has no heading #{anchor}"


def test_the_readme_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines: move detail to docs/"


def test_every_setting_is_in_the_settings_table():
    from service.core.settings import Settings
    table = (ROOT / "docs" / "serving.md").read_text().partition("\n## Settings\n")[2].split("\n## ")[0]
    missing = [f"VITSERVE_{name.upper()}" for name in Settings.model_fields if f"VITSERVE_{name.upper()}`" not in table]
    assert not missing, f"docs/serving.md#settings lacks {', '.join(missing)} (service/core/settings.py)"
