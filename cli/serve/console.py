"""What `switchyard serve` tells the person at the terminal: the live start-up status on
stderr, and on stdout the lines to paste (base URL, key, a `curl` and an `openai` call)."""

import sys
import time
from pathlib import Path
from typing import Any

from cli.logs import route_uvicorn_logs

__all__ = ["Status", "banner", "note", "route_uvicorn_logs"]


def note(text: str) -> None:
    print(f"switchyard: {text}", file=sys.stderr, flush=True)


class Status:
    """A live status line: rich's spinner on a terminal, else a line per change."""

    def __init__(self) -> None:
        self._live = None
        self._last = ""

    def __enter__(self) -> "Status":
        if sys.stderr.isatty():
            try:
                from rich.console import Console

                self._live = Console(stderr=True).status("starting")
                self._live.__enter__()
            except ImportError:
                self._live = None
        return self

    def update(self, text: str) -> None:
        if self._live is not None:
            self._live.update(text)
            return
        stable = text.rsplit(" · ", 1)[0]  # without the elapsed seconds
        if stable != self._last:
            self._last = stable
            note(text)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)


_PROMPT = "Say hello in one sentence."


def banner(
    url: str, key: str | None, saved: dict[str, Any], tenant: str, cfg: Any, data_dir: Path
) -> None:
    models = ", ".join(
        f"{n} = {p.model_dir or p.model} ({p.min_replicas}..{p.max_replicas} replicas)"
        for n, p in cfg.pools.items()
    )
    base = f"{url}/v1"
    out = [
        "",
        f"Switchyard is serving at {url}",
        f"  pools: {models}",
    ]
    if cfg.cascade.enabled:
        out.append(
            f'  model "auto": the cascade picks {cfg.cascade.small_pool} or '
            f"{cfg.cascade.large_pool} per request"
        )
    if key is not None:
        out += [
            "",
            f"# Tenant {tenant!r} and its API key were created now. The key is shown only",
            "# this once: paste these lines into a shell (or eval them).",
            f"export OPENAI_BASE_URL={base}",
            f"export OPENAI_API_KEY={key}",
            "",
            "# Then try it:",
            'curl -s "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer '
            '$OPENAI_API_KEY" -H "Content-Type: application/json" -d '
            f'\'{{"model": "auto", "messages": [{{"role": "user", "content": "{_PROMPT}"}}], '
            '"max_tokens": 32}\'',
            "",
            "python - <<'EOF'",
            "from openai import OpenAI  # reads OPENAI_BASE_URL and OPENAI_API_KEY",
            "r = OpenAI().chat.completions.create(",
            f'    model="auto", messages=[{{"role": "user", "content": "{_PROMPT}"}}], '
            "max_tokens=32)",
            "print(r.model, r.choices[0].message.content)",
            "EOF",
        ]
    else:
        when = saved.get("shown_at")
        shown = (
            time.strftime("%Y-%m-%d %H:%M", time.localtime(when)) if when else "an earlier start"
        )
        out += [
            "",
            f"export OPENAI_BASE_URL={base}",
            f"# The API key of tenant {tenant!r} was printed at the first start ({shown});",
            f"# a new one: switchyard admin create-key {tenant}",
        ]
    out += [
        "",
        "Fleet: switchyard admin fleet    Load: switchyard load --rate 5 --duration 30",
        f"Logs: {data_dir / 'logs'}    Stop: Ctrl-C",
        "",
    ]
    print("\n".join(out), flush=True)
