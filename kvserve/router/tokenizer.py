"""The replicas' tokenization without transformers (whose AutoTokenizer imports torch).

`tokenizer.json` is read by the `tokenizers` package, the very backend transformers wraps;
the chat template is rendered by jinja2 in the environment transformers builds for it
(`transformers.utils.chat_template_utils`): a sandbox with trim_blocks and lstrip_blocks,
loop controls, a `{% generation %}` tag, `raise_exception`, `strftime_now`, a `tojson`
that keeps non-ASCII, and the named special tokens as variables. The replica renders
with `add_generation_prompt=True` and encodes without special tokens; so does this.
`replicas.py` checks the result against a replica's `/tokenize` before trusting it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names templates read (`bos_token` ...)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` in templates, without attribute access to the type (as transformers limits it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)`, refusing underscore names (a sandbox escape route)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes: {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _token_text(value: object) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken as a dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_source(tokenizer_dir: Path, config: dict[str, Any]) -> str | None:
    """Where transformers finds it: chat_template.jinja, else tokenizer_config.json (a string or named list)."""
    jinja_file = tokenizer_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the replica (no tools) uses "default"
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if template is None and (tokenizer_dir / "chat_template.json").is_file():
        template = json.loads((tokenizer_dir / "chat_template.json").read_text()).get("chat_template")
    return template if isinstance(template, str) else None


@dataclass
class RouterTokenizer:
    tokenizer: Tokenizer
    chat_template: jinja2.Template | None
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template sees them

    @classmethod
    def from_dir(cls, tokenizer_dir: str | Path) -> RouterTokenizer:
        path = Path(tokenizer_dir)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
        source = _chat_template_source(path, config)
        template = compile_chat_template(source) if source is not None else None
        return cls(Tokenizer.from_file(str(path / "tokenizer.json")), template, special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As the replica tokenizes a prompt (its request's `add_special_tokens`, vLLM's default)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt the replica builds from chat messages (ValueError or TemplateError as it would raise)."""
        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        return self.chat_template.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=True, **self.special_tokens
        )

    def encode_chat(self, messages: list[dict[str, str]], add_special_tokens: bool = False) -> list[int]:
        return self.encode(self.render_chat(messages), add_special_tokens)
