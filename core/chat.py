"""Chat templates from tokenizer_config.json (``chat_template``: a string or a named list) or a
sidecar ``chat_template.jinja``, rendered in jinja2's ImmutableSandboxedEnvironment."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

from .errors import ChatTemplateError


def find_template(model_dir: Path, config: dict | None = None, name: str = "default") -> str | None:
    """The model's chat template text, or None."""
    model_dir = Path(model_dir)
    sidecar = model_dir / "chat_template.jinja"
    if sidecar.is_file():
        return sidecar.read_text(encoding="utf-8")
    if config is None:
        cfg = model_dir / "tokenizer_config.json"
        config = json.loads(cfg.read_text(encoding="utf-8")) if cfg.is_file() else {}
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get(name) or named.get("default") or next(iter(named.values()), None)
    if tpl is None:
        side = model_dir / "chat_template.json"
        if side.is_file():
            try:
                tpl = json.loads(side.read_text(encoding="utf-8")).get("chat_template")
            except json.JSONDecodeError:
                tpl = None
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def _raise_exception(message):
    raise ChatTemplateError(f"the model's chat template rejected the conversation: {message}")


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False, **_: json.dumps(
        v, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def render_template(template: str, messages: list[dict], *, bos_token: str | None = None,
                    eos_token: str | None = None, add_generation_prompt: bool = True,
                    tools=None, **extra) -> str:
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError

    try:
        tpl = _environment().from_string(template)
        return tpl.render(messages=messages, bos_token=bos_token or "", eos_token=eos_token or "",
                          add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateError(f"the chat template tried an unsafe operation and was stopped: {exc}") from None
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed to render: {exc}") from None


def render_chat(model, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
    """Render ``messages`` with the model's template. A model without one gets an error that says
    so (pass ``--no-chat`` / chat=False, or add a chat_template.jinja to the model directory)."""
    tpl = find_template(model.model_dir, model.tokenizer.config)
    if tpl is None:
        raise ChatTemplateError(
            f"{model.model_dir} has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); run without --chat, or add a chat_template.jinja")
    tok = model.tokenizer
    return render_template(tpl, messages, bos_token=tok.bos_token, eos_token=tok.eos_token,
                           add_generation_prompt=add_generation_prompt, **extra)
