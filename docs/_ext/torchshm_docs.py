"""Sphinx directives for torchshm's docs: the API reference and the Notes index.

Note [API from JSON]
Debian's Sphinx runs on Debian's Python, and the torchshm that `make docs`
documents is built for the pip stack (.venv), so autodoc cannot import it.
scripts/api_dump.py imports torchshm in .venv and writes each public name's
kind, signature and docstring to JSON; `torchshm-api` renders entries from it
as Python-domain objects (so `:func:` references, the index and the search
work), with the NumPy-style sections converted by napoleon, as autodoc would.
Every public name must be rendered exactly once: a name the pages forget, or
one they name that is not public, is a build warning (an error in `make
docs`).
"""

import json
import re
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.ext.napoleon import Config
from sphinx.ext.napoleon.docstring import NumpyDocstring
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)

DIRECTIVE = {
    "function": "py:function",
    "class": "py:class",
    "exception": "py:exception",
    "method": "py:method",
    "property": "py:property",
    "module": "py:module",
}


def _api(env, reading=True):
    path = Path(env.config.torchshm_api_json)
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: no API dump; `make docs` writes it (scripts/api_dump.py)"
        )
    if reading:  # the page being read depends on it
        env.note_dependency(str(path))
    return json.loads(path.read_text())


def _converted(env, doc, what, name):
    """reStructuredText of a NumPy-style docstring, as napoleon gives autodoc."""
    config = Config(**{k: env.config[k] for k in Config._config_values})
    return str(NumpyDocstring(doc, config, what=what, name=name)).splitlines()


def _entry(env, module, entry, indent=""):
    """Lines of the Python-domain directive for one public name."""
    kind, name = entry["kind"], entry["name"]
    header = f"{indent}.. {DIRECTIVE[kind]}:: {name}{entry.get('signature') or ''}"
    lines = [header, f"{indent}   :module: {module}", ""]
    what = "attribute" if kind == "property" else kind
    for line in _converted(env, entry["doc"], what, f"{module}.{name}"):
        lines.append(f"{indent}   {line}" if line else "")
    lines.append("")
    for member in entry.get("members", []):
        lines += _entry(env, f"{module}.{name}", member, indent + "   ")
    return lines


class ApiDirective(SphinxDirective):
    """``.. torchshm-api:: MODULE`` with ``:names: a b c``: those public names
    of MODULE, in that order (``:module-doc:`` renders the module's docstring
    first)."""

    required_arguments = 1
    option_spec = {
        "names": directives.unchanged,
        "module-doc": directives.flag,
    }

    def run(self):
        api = _api(self.env)
        module = self.arguments[0]
        public = {e["name"]: e for e in api["modules"].get(module, {}).get("names", [])}
        if module not in api["modules"]:
            raise self.error(f"{module} is not a documented module")
        rendered = self.env.__dict__.setdefault("torchshm_rendered", {})
        lines = []
        if "module-doc" in self.options:
            doc = api["modules"][module]["doc"]
            lines += [f".. py:module:: {module}", ""]
            lines += _converted(self.env, doc, "module", module) + [""]
        for name in (self.options.get("names") or "").split():
            if name not in public:
                raise self.error(f"{module}.{name} is not a public name")
            rendered.setdefault(f"{module}.{name}", []).append(self.env.docname)
            lines += _entry(self.env, module, public[name])
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, "api.json"), node)
        return node.children


NOTE = re.compile(r"^\s*(?://|#|\"\"\")?\s*Note \[([^\]]+)\]\s*$")


def _notes(root):
    """(title, path, line, text) of every Note defined in csrc/ and torchshm/.

    A Note is defined by a line that holds only `Note [Title]` (a `//` or `#`
    comment, or a docstring line); its text runs to the end of that comment
    block or docstring, or to the next Note."""
    root = Path(root)
    found = []
    files = sorted(root.glob("csrc/*.[ch]*")) + sorted(root.glob("torchshm/**/*.py"))
    for path in files:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            match = NOTE.match(line)
            if not match:
                continue
            stripped = line.strip()
            comment = next((c for c in ("//", "#") if stripped.startswith(c)), None)
            text = []
            for following in lines[i + 1 :]:
                stripped = following.strip()
                if NOTE.match(following):
                    break
                if comment:
                    if not stripped.startswith(comment):
                        break
                    text.append(stripped[len(comment) :].removeprefix(" "))
                else:
                    if '"""' in stripped:
                        text.append(stripped.split('"""')[0])
                        break
                    text.append(following.rstrip())
            while text and re.fullmatch(r"[~=-]*", text[0].strip()):
                text.pop(0)  # the title's underline, a blank line
            while text and not text[-1].strip():
                text.pop()
            rel = str(path.relative_to(root))
            found.append((match.group(1), rel, i + 1, "\n".join(text)))
    return sorted(found, key=lambda note: note[0].lower())


class NotesDirective(SphinxDirective):
    """``.. torchshm-notes::``: every Note in the source, its place and text."""

    def run(self):
        root = Path(self.env.config.torchshm_source_root)
        result = []
        for title, rel, line, text in _notes(root):
            self.env.note_dependency(str(root / rel))
            section = nodes.section(ids=[nodes.make_id(f"note-{title}")])
            section += nodes.title(text=f"Note [{title}]")
            where = nodes.paragraph()
            where += nodes.literal(text=f"{rel}:{line}")
            section += where
            section += nodes.literal_block(text=text, language="none")
            result.append(section)
        if not result:
            raise self.error("no Note found under csrc/ and torchshm/")
        return result


def _check_every_name_rendered(app, env):
    """Every public name on exactly one API entry (Note [API from JSON])."""
    rendered = env.__dict__.get("torchshm_rendered", {})
    api = _api(env, reading=False)
    for module, info in api["modules"].items():
        for entry in info["names"]:
            qualified = f"{module}.{entry['name']}"
            places = rendered.get(qualified, [])
            if len(places) != 1:
                logger.warning(
                    f"{qualified} is rendered {len(places)} times in the API"
                    f" reference ({', '.join(places) or 'nowhere'})"
                )


def _forget_rendered(app, env, docname):
    rendered = env.__dict__.get("torchshm_rendered", {})
    for places in rendered.values():
        while docname in places:
            places.remove(docname)


# A page's links that the site replaces with the linked file, included as
# MyST's {include} with these options. A code host shows an {include} as raw
# text, so the page links to the file (on a line of its own), which a code
# host renders, and the site shows it in place (the site has no page for it).
INCLUDED_LINKS = {
    "benchmarks": {
        "figures/reference-run.md": [":relative-images:"],
        "../benchmarks/README.md": [
            ':start-after: "<!-- docs: start -->"',
            ':end-before: "<!-- docs: end -->"',
        ],
    },
}


def _include_linked_files(app, docname, source):
    for target, options in INCLUDED_LINKS.get(docname, {}).items():
        line = re.compile(rf"^.*\]\({re.escape(target)}\).*$", re.M)
        directive = "\n".join([f"```{{include}} {target}", *options, "```"])
        source[0], count = line.subn(lambda _: directive, source[0])
        if count != 1:
            logger.warning(f"{docname}: {count} lines link to {target}, not 1")


def setup(app):
    app.connect("source-read", _include_linked_files)
    app.add_config_value("torchshm_api_json", "", "env")
    app.add_config_value("torchshm_source_root", "", "env")
    app.add_directive("torchshm-api", ApiDirective)
    app.add_directive("torchshm-notes", NotesDirective)
    app.connect("env-purge-doc", _forget_rendered)
    app.connect("env-check-consistency", _check_every_name_rendered)
    return {"version": "1", "parallel_read_safe": False}
