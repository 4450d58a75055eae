"""The docs stay true: every path, module, ``python -m`` command, make target and link the Markdown files name
exists, every command of a fenced example parses its options (argparse, in this process: the parser of the command
it names, stopped once it has parsed), and docs/options.md is what ``python -m lab options`` generates."""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.machinery
import importlib.util
import io
import os
import re
import runpy
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
# the folders a path in the docs may start with, and the files at the top
ROOTS = ("lab", "analysis", "sweeps", "tests", "benchmarks", "configs", "launch", "docs", ".ci")
TOP_FILES = ("Makefile", "pyproject.toml", "constraints-cpu.txt", "README.md")
PACKAGES = ("lab", "analysis", "sweeps")
PATH = re.compile(r"(?<![\w./$~(-])((?:" + "|".join(re.escape(r) for r in ROOTS) + r")/[\w./{},*-]*[\w}/*])"
                  r"(?:::(\w+))?")
FILE_TYPES = ("md", "py", "json", "jsonl", "csv", "png", "svg", "pdf", "toml", "txt", "html", "tex", "log", "db", "sh")
MODULE = re.compile(r"(?<![\w./(-])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)(?![\w/-])")
PYTHON_M = re.compile(r"python3? -m ([\w.]+)((?: +[a-z][\w-]*)?)")
INLINE_COMMAND = re.compile(r"`((?:python3? |torchrun )[^`\n]+)`")
MAKE = re.compile(r"(?<![\w-])make ([a-z][\w-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELLS = ("bash", "sh", "shell", "console")  # a fence without a language shows output


@dataclass(frozen=True)
class Problem:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def markdown_files() -> list[Path]:
    """Every Markdown file of the repository (not the environment, runs or caches)."""
    skip = {".venv", ".git", "runs", "data", "node_modules"}
    return sorted(p for p in ROOT.rglob("*.md") if not skip & set(p.relative_to(ROOT).parts)
                  and not any(part.endswith(".egg-info") for part in p.parts))


def line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


# ---------------------------------------------------------------- what exists


def expand(path: str) -> list[str]:
    """``a/{b,c}.md`` as ``a/b.md`` and ``a/c.md``."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [p for alt in match.group(1).split(",") for p in expand(path[:match.start()] + alt + path[match.end():])]


def path_problem(path: str, test: str | None) -> str | None:
    for one in expand(path.rstrip(".,")):
        if "*" in one:
            if not list(ROOT.glob(one)):
                return f"path {one} matches nothing"
            continue
        if not (ROOT / one).exists() and not list(ROOT.glob(glob_escape(one) + ".*")):  # nor a stem: --out OUT
            return f"path {one} does not exist"
        if test and not re.search(rf"^(?:async )?def {test}\b", (ROOT / one).read_text(), re.MULTILINE):
            return f"test {one}::{test} does not exist"
    return None


def glob_escape(path: str) -> str:
    return re.sub(r"([\[\]?*])", r"[\1]", path)


def top_level_names(module_file: Path) -> dict[str, set[str]]:
    """The names a module's source defines at its top level, each with the names its class body defines."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} | {
                t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update({t.id: set() for t in ast.walk(target) if isinstance(t, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: set() for a in node.names})
    return names


def find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # a parent that is a module, not a package
        return None


def module_problem(dotted: str) -> str | None:
    """None when ``dotted`` is a module of the lab, or a name (and a class's attribute) one defines (or a file name,
    ``analysis.md``)."""
    parts = dotted.split(".")
    if parts[-1] in FILE_TYPES:
        return None
    for cut in range(len(parts), 0, -1):
        spec = find_spec(".".join(parts[:cut]))
        if spec is None or spec.origin is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        names = top_level_names(Path(spec.origin))
        if rest[0] not in names:  # of a package: a submodule that is not there
            return (f"no module {'.'.join(parts[:cut + 1])}" if spec.submodule_search_locations
                    else f"module {'.'.join(parts[:cut])} has no {rest[0]} ({dotted})")
        if len(rest) > 1 and names[rest[0]] and rest[1] not in names[rest[0]]:
            return f"{'.'.join(parts[:cut + 1])} has no {rest[1]} ({dotted})"
        return None
    return f"no module {dotted}"


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


# pages another branch writes, linked ahead of its merge (the reliability issue's table of bad inputs)
def link_problem(md: Path, target: str) -> str | None:
    if re.match(r"[a-z]+:", target):
        return None  # a web address
    file, _, anchor = target.partition("#")
    dest = (md.parent / file).resolve() if file else md
    if not dest.exists():
        return f"link {target}: {file} does not exist"
    if anchor and dest.suffix == ".md":
        anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.MULTILINE)}
        if anchor not in anchors:
            return f"link {target}: no heading #{anchor} in {dest.relative_to(ROOT)}"
    return None


def python_m_problem(module: str, sub: str) -> str | None:
    spec = find_spec(module)
    if spec is None:
        return f"python -m {module}: no such module"
    if spec.submodule_search_locations and find_spec(f"{module}.__main__") is None:
        return f"python -m {module}: a package without __main__"
    if not sub.strip():
        return None
    return parse_problem(["python", "-m", module, sub.strip(), "--help"])


def placeholder(word: str) -> bool:
    """A word standing for a value the reader supplies: RUN, N, OUT.json, [NAME ...], plan/run/status, ..."""
    return (bool(re.fullmatch(r"[A-Z][A-Z0-9_]*(\.\w+)?|[a-z-]+(/[a-z-]+)+", word))
            or any(c in word for c in "[]<>|…") or "..." in word)


# what an inline mention may leave out (the arguments a command requires) is no error there; what it names must exist
NAMED_BUT_MISSING = ("unknown option", "unrecognized arguments", "invalid choice", "no such command", "does not exist")


def inline_problem(span: str) -> str | None:
    """An inline ``python -m ...`` command names only options and subcommands its parser knows."""
    try:
        words = shlex.split(span)
    except ValueError:
        return None
    try:
        if any(placeholder(w) for w in words) or (argv := program(words)) is None:
            return None
    except ValueError:  # torchrun's options alone, without the program they start
        return None
    problem = parse_problem(argv)
    return problem if problem and any(m in problem for m in NAMED_BUT_MISSING) else None


def named_things(md: Path) -> list[Problem]:
    """Every path, module, python -m command, make target and link ``md`` names that does not exist."""
    text, problems = md.read_text(), []
    where = md.relative_to(ROOT)
    # commands only where they are code (a fence or `a span`): prose says "make" too
    code = re.sub(r"[^\n]", " ", text)
    for m in [*FENCE.finditer(text), *re.finditer(r"`[^`\n]+`", text)]:
        code = code[:m.start()] + m.group(0) + code[m.end():]
    checks = [(PATH, text, lambda m: path_problem(m.group(1), m.group(2))),
              (MODULE, text, lambda m: module_problem(m.group(1))),
              (PYTHON_M, code, lambda m: python_m_problem(m.group(1), m.group(2))),
              (INLINE_COMMAND, text, lambda m: inline_problem(m.group(1))),
              (MAKE, code, lambda m: None if m.group(1) in make_targets() else f"make {m.group(1)}: no such target"),
              (LINK, text, lambda m: link_problem(md, m.group(1)))]
    for pattern, where_to_look, check in checks:
        seen = set()
        for m in pattern.finditer(where_to_look):
            if m.group(0) in seen:
                continue
            seen.add(m.group(0))
            problem = Problem(f"{where}:{line_of(text, m.start())}", what) if (what := check(m)) else None
            if problem is not None and problem not in problems:
                problems.append(problem)
    for name in TOP_FILES:
        for m in re.finditer(rf"`{re.escape(name)}`", text):
            if not (ROOT / name).exists():
                problems.append(Problem(f"{where}:{line_of(text, m.start())}", f"{name} does not exist"))
    return problems


# ---------------------------------------------------------------- what parses


class Parsed(BaseException):
    """Raised once a command's parser has accepted its arguments (a BaseException: no ``except Exception`` of the
    command catches it)."""


@contextlib.contextmanager
def stop_after_parsing():
    """argparse's parse_args parses as ever, then stops the program (which did nothing but import before it)."""
    names = ("parse_args", "parse_intermixed_args")
    real = {name: getattr(argparse.ArgumentParser, name) for name in names}

    def stopping(parse):
        def parse_then_stop(self, args=None, namespace=None):
            parse(self, args, namespace)
            raise Parsed
        return parse_then_stop

    for name in names:
        setattr(argparse.ArgumentParser, name, stopping(real[name]))
    try:
        yield
    finally:
        for name in names:
            setattr(argparse.ArgumentParser, name, real[name])


def commands(block: str, console: bool) -> list[list[str]]:
    """The commands of a shell example: continuations joined, comments and prompts dropped, split at ; && ||."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        if console:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        command: list[str] = []
        for word in words + [";"]:
            if word in (";", "&&", "||", "|") or word.endswith(";"):
                command += [word[:-1]] if word.endswith(";") and len(word) > 1 else []
                if command:
                    out.append(command)
                command = []
            else:
                command.append(word)
    return out


def program(words: list[str]) -> list[str] | None:
    """The lab's program a shell command runs, as [python, -m, module, args...] or [python, script.py, args...]
    (torchrun's own options parsed by torchrun's parser); None for anything else."""
    words = list(words)
    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] in ("nice", "timeout", "/usr/bin/time")):
        skip = {"nice": 3, "timeout": 2, "/usr/bin/time": 2 if words[1:2] == ["-v"] else 1}.get(words[0], 1)
        words = words[skip:]
    if not words:
        return None
    exe = Path(words[0]).name
    if exe in ("python", "python3") and words[1:3] == ["-m", "lab.runtime.loopback"]:
        exe, words = "torchrun", words[2:]  # torchrun with its stores on 127.0.0.1: run, it would patch torch here
    if exe == "torchrun":
        from torch.distributed.run import get_args_parser

        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                args = get_args_parser().parse_args(words[1:])
        except SystemExit:
            raise ValueError(f"torchrun {' '.join(words[1:])}: {stderr.getvalue().strip()}") from None
        return (["python", "-m", args.training_script, *args.training_script_args] if args.module
                else ["python", args.training_script, *args.training_script_args])
    if exe in ("python", "python3") and len(words) > 2 and words[1] == "-m" and words[2].split(".")[0] in PACKAGES:
        return ["python", *words[1:]]
    if exe in ("python", "python3") and len(words) > 1 and words[1].startswith(("launch/", "benchmarks/")):
        return ["python", *words[1:]]
    return None  # not the lab's: pip, venv, pytest, tensorboard, ...


@contextlib.contextmanager
def fresh_main(module: str):
    """Run a module (a package's __main__) as python -m does, though a test imported it already (runpy would
    warn)."""
    name = f"{module}.__main__" if find_spec(module).submodule_search_locations else module
    imported = sys.modules.pop(name, None)
    try:
        yield
    finally:
        if imported is not None:
            sys.modules[name] = imported


def parse_problem(argv: list[str]) -> str | None:
    """None when the program ``argv`` names ([python, -m, module, ...] or [python, script.py, ...]) accepts its
    options; else the error its parser printed."""
    stderr, stdout = io.StringIO(), io.StringIO()
    module = argv[2] if argv[1] == "-m" else None
    args = argv[3:] if module else argv[2:]
    if module is None and not (ROOT / argv[1]).is_file():
        return f"{argv[1]} does not exist"
    if module and find_spec(module) is None:
        return f"python -m {module}: no such module"
    if module is None and "parse_args" not in (ROOT / argv[1]).read_text():
        return None  # a script without options: runs, nothing to parse
    saved = sys.argv, list(sys.path), dict(os.environ)  # what a program may change before it parses
    try:
        with (stop_after_parsing(), contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout),
              warnings.catch_warnings()):
            warnings.simplefilter("ignore")  # what a program warns of as it imports (torch's fault handler on a
            # captured stderr) is no concern of its options
            if module == "lab" and args and not args[0].startswith("-"):
                from lab.commands.entry import COMMANDS

                if args[0] not in COMMANDS:
                    return f"python -m lab {args[0]}: no such command"
                name, function, _ = COMMANDS[args[0]]
                getattr(importlib.import_module(name), function)(args[1:], prog=f"python -m lab {args[0]}")
            elif module:
                sys.argv = [module, *args]
                with fresh_main(module):
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [argv[1], *args]
                runpy.run_path(str(ROOT / argv[1]), run_name="__main__")
    except Parsed:
        return None
    except SystemExit as e:
        if e.code in (0, None):  # --help
            return None
        return f"{' '.join(argv)}: {stderr.getvalue().strip() or f'exit {e.code}'}"
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.environ.clear()
        os.environ.update(saved[2])
    return f"{' '.join(argv)}: ran without parsing its options through argparse"


def example_problems(md: Path) -> list[Problem]:
    """Every command of ``md``'s shell examples that its program's parser refuses."""
    text, problems = md.read_text(), []
    for fence in FENCE.finditer(text):
        if fence.group(1) not in SHELLS:
            continue
        console = fence.group(1) == "console"
        for words in commands(fence.group(2), console):
            try:
                argv = program(words)
            except ValueError as e:
                problems.append(Problem(f"{md.relative_to(ROOT)}:{line_of(text, fence.start())}", str(e)))
                continue
            if argv is None or any("$" in w for w in argv):
                continue  # not the lab's, or a shell variable's value the example does not give
            if (what := parse_problem(argv)) is not None:
                problems.append(Problem(f"{md.relative_to(ROOT)}:{line_of(text, fence.start())}", what))
    return problems


# ---------------------------------------------------------------- the tests


def test_every_path_module_command_target_and_link_the_docs_name_exists():
    problems = [p for md in markdown_files() for p in named_things(md)]
    assert not problems, "\n".join(map(str, problems))


def test_every_command_of_a_fenced_example_parses_its_options():
    problems = [p for md in markdown_files() for p in example_problems(md)]
    assert not problems, "\n".join(map(str, problems))


def test_the_option_reference_is_what_the_config_generates(tmp_path, capsys):
    from lab.commands.options import main, reference

    assert (ROOT / "docs" / "options.md").read_text() == reference(), \
        "docs/options.md is stale: regenerate it with make docs (python -m lab options --out docs/options.md)"
    assert main(["--out", str(tmp_path / "new" / "options.md")]) == 0
    assert (tmp_path / "new" / "options.md").read_text() == reference()
    (tmp_path / "file").write_text("")
    assert main(["--out", str(tmp_path / "file" / "options.md")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: --out {tmp_path / 'file'} is a file, not a folder"


def test_the_checks_fail_when_a_named_thing_disappears():
    """A page naming what does not exist fails each check, naming what is missing."""
    page = ROOT / "docs" / "a-page-for-this-test.md"
    text = ("See `lab/runtime/configs.py`, `tests/test_docs.py::test_gone`, `lab.runtime.config.NO_SUCH`, "
            "`lab.measure.acounting`, `python -m lab trian`, `python -m lab.nowhere`, `make tests`, "
            "`python -m lab train --model.d_modle 64` and "
            "[the options](options.md#no-such-heading).\n\n```bash\n"
            "python -m lab train --config configs/demo.toml --train.tokns 1e6\n"
            "python -m sweeps plan sweeps/tiny_isoflop.toml --nprocs 2\n"
            "python -m analysis fit runs/ --out fits/ --predict 1e21\n```\n")
    try:
        page.write_text(text)
        found = [p.what for p in named_things(page)] + [p.what for p in example_problems(page)]
    finally:
        page.unlink()
    expected = ["path lab/runtime/configs.py does not exist", "test tests/test_docs.py::test_gone does not exist",
                "module lab.runtime.config has no NO_SUCH", "no module lab.measure.acounting",
                "python -m lab trian", "python -m lab.nowhere: no such module", "no module lab.nowhere",
                "make tests: no such target", "unknown option --model.d_modle (did you mean --model.d_model?)",
                "link options.md#no-such-heading: no heading #no-such-heading",
                "unknown option --train.tokns (did you mean --train.tokens?)", "unrecognized arguments: --nprocs"]
    for what in expected:
        assert any(what in f for f in found), (what, found)
    assert not any("analysis fit" in f for f in found), found  # a command that parses passes
    assert len(found) == len(expected), found
