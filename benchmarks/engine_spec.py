"""`switchyard bench engine --scenarios speculative`: n-gram speculative decoding at c=1.

One request at a time on the real default model (SmolLM2-135M-Instruct, fetched once into
$SWITCHYARD_CACHE or ~/.cache/switchyard; `--model DIR` for another), greedy, through two
engines side by side in one process: speculation off (`method: none`) and on (`ngram`).
Each prompt runs on both, in alternating order, so a shared machine's noise falls on both
alike. Two loads: copy-heavy (repeat or lightly rewrite a ~300-token passage: the output
copies its prompt) and free chat (open questions: little to copy). Reported per load: the
acceptance rate (drafts kept over drafts verified), tokens per step, and output tokens per
second of request time (prefill included) and of decode time (after the first token), off
and on. Greedy output is the same with and without speculation, so both emit the same
tokens and the ratio is of time alone (the run checks it).
"""

import gc
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.stats import markdown_table

PASSAGES = [
    "The harbour town wakes before dawn. Fishing boats slip out past the breakwater while "
    "the bakery on the corner fires its ovens, and the smell of bread drifts down to the "
    "quay. By six the market stalls are up: crates of mackerel and crab on ice, baskets of "
    "early potatoes, bunches of flowers wrapped in newspaper. Tourists arrive on the first "
    "ferry at nine and wander between the stalls with coffee in paper cups. The harbour "
    "master watches the weather from his office above the chandlery, because the wind can "
    "turn in an hour and the small boats must be back before it does. In the afternoon the "
    "town grows quiet. Shopkeepers sweep their steps, children jump from the harbour wall "
    "into the cold green water, and old men play cards outside the pub. When the boats "
    "return in the evening, the gulls follow them in, and the whole town gathers to see "
    "what the sea has given that day.",
    "A solar panel turns light into electricity through the photovoltaic effect. Each cell "
    "is made of two thin layers of silicon, one treated to have extra electrons and the "
    "other to have too few. Where the layers meet, an electric field forms. When sunlight "
    "strikes the cell, it knocks electrons loose, and the field pushes them in one "
    "direction, creating a current. Metal contacts on the top and bottom of the cell carry "
    "that current out to a circuit. A single cell produces only about half a volt, so "
    "manufacturers wire dozens of cells together into a panel, and panels together into an "
    "array. The current they produce is direct current, so an inverter converts it to the "
    "alternating current used by homes and the grid. Panels work best when they face the "
    "sun directly and stay cool, since heat lowers their efficiency. Dust, shade and snow "
    "also reduce output, which is why panels are often tilted and cleaned regularly.",
    "Our team will move to the new office on the third floor next month. Before the move, "
    "please pack the contents of your desk into the boxes provided and label each box with "
    "your name and new desk number. Computers, monitors and phones will be moved by the "
    "facilities team, so do not pack them, but do unplug every cable and place the cables "
    "in the small bag taped to your monitor. Personal items such as plants, photographs "
    "and mugs should be taken home over the weekend of the move. The new office has "
    "standing desks, two quiet rooms for calls and a larger kitchen with a coffee machine. "
    "Parking stays the same, but the entrance is now on the north side of the building. "
    "If you have questions about the move, ask your manager or write to the facilities "
    "team, who will answer within one working day. Thank you for your help in making the "
    "move go smoothly.",
    "The old library stood at the top of the hill, its stone walls dark with ivy. Inside, "
    "the reading room was long and narrow, lit by tall windows on one side and lined with "
    "shelves on the other. The librarian, a tall woman with silver hair, kept a card index "
    "in wooden drawers and knew where every book belonged. Students came in the afternoons "
    "to work at the long oak tables, and the only sounds were pages turning and the clock "
    "ticking above the door. On rainy days the room filled with the smell of wet coats and "
    "old paper. Children were welcome on Saturday mornings, when the librarian read stories "
    "aloud by the fireplace at the far end of the room. Many of them grew up to bring their "
    "own children, and some of them still remember the stories she chose, and the way she "
    "closed the book at the end and waited a moment before anyone spoke.",
]
COPY_INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{passage}",
    "Copy out the following text, and do not change anything:\n\n{passage}",
]
CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy? Explain each one.",
    "Explain how a rainbow forms, as you would to a ten-year-old.",
    "Give me some ideas for a birthday party for my grandmother.",
    "Why do people enjoy music? Write a few paragraphs.",
    "Describe your ideal weekend in the mountains.",
    "What should I think about before adopting a dog?",
    "Write a letter to a friend who has just moved to a new city.",
]


def default_model_dir() -> Path:
    """The default real model, fetched once into the Switchyard cache."""
    import os

    from workers.models.fetch import fetch_model
    from workers.models.registry import default_model

    cache = Path(os.environ.get("SWITCHYARD_CACHE") or Path.home() / ".cache" / "switchyard")
    return fetch_model(default_model(), cache, show_progress=False).path


def workloads(quick: bool) -> dict[str, list[str]]:
    """The two loads' user messages."""
    copy = [
        instruction.format(passage=passage)
        for passage in PASSAGES
        for instruction in COPY_INSTRUCTIONS
    ]
    chat = list(CHAT_PROMPTS)
    return {"copy": copy[:2] if quick else copy, "chat": chat[:2] if quick else chat}


# The engines a run compares: speculation off, on, and on with no decode workspace (every
# decode reads its blocks in place: what keeping speculating requests out of the workspace
# costs and saves at c=1, against dropping a row for a verify step and gathering it again).
VARIANTS = {
    "off": {"method": "none"},
    "on": {"method": "ngram"},
    "on_no_workspace": {"method": "ngram", "workspace": False},
}


def _engine(ckpt: str, dtype: str, num_tokens: int, method: str, workspace: bool = True):
    gc.collect()
    from workers.engine.config import EngineConfig, SchedulerConfig, SpeculativeConfig
    from workers.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        dtype=dtype,
        calibrate=False,
        scheduler=SchedulerConfig(max_num_seqs=8),
        decode_workspace_tokens=1024 if workspace else 0,
        speculative=SpeculativeConfig(method=method, num_tokens=num_tokens),
    )
    return LLMEngine.from_pretrained(ckpt, cfg)


def _side_by_side(engines: dict[str, Any], prompt_ids: list[int], max_tokens: int, tag: str):
    """The same request on each engine, their steps taken in turn (in `engines`' order),
    so that a shared machine's slow moments fall on all of them alike. Per engine: its
    output, the time its steps took, its time to first token (its steps' time until
    then), its steps and its drafts."""
    from workers.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    got: dict[str, dict[str, Any]] = {}
    for name, engine in engines.items():
        engine.add_request(f"{tag}-{name}", prompt_token_ids=prompt_ids, params=params)
        got[name] = {
            "tokens": [],
            "wall_s": 0.0,
            "ttft_s": None,
            "steps": 0,
            "proposed": -engine.num_spec_proposed_tokens,
            "accepted": -engine.num_spec_accepted_tokens,
        }
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            t0 = time.perf_counter()
            outs = engine.step()
            row = got[name]
            row["wall_s"] += time.perf_counter() - t0
            row["steps"] += 1
            for o in outs:
                row["tokens"] += o.new_token_ids
            if row["ttft_s"] is None and row["tokens"]:
                row["ttft_s"] = row["wall_s"]
    for name, engine in engines.items():
        got[name]["proposed"] += engine.num_spec_proposed_tokens
        got[name]["accepted"] += engine.num_spec_accepted_tokens
    return got


def _chat_ids(tok, message: str) -> list[int]:
    return tok.encode(tok.render_chat([{"role": "user", "content": message}]), False)


def run_speculative(spec: dict) -> dict:
    """The engines (`spec["variants"]`, default off and on) over the loads, prompt by
    prompt, taking turns at going first."""
    ckpt = spec["ckpt"] or str(default_model_dir())
    names = spec.get("variants", ["off", "on"])
    engines = {n: _engine(ckpt, spec["dtype"], spec["num_tokens"], **VARIANTS[n]) for n in names}
    tok = engines["on"].tokenizer
    assert tok is not None, "the checkpoint needs a tokenizer"
    # Warm them (kernels, allocator) on a prompt of each load.
    for prompts in spec["loads"].values():
        _side_by_side(engines, _chat_ids(tok, prompts[0]), 8, "warm")
    result: dict[str, Any] = {"model": ckpt, "variants": names, "loads": {}}
    i = 0
    for load, prompts in spec["loads"].items():
        rows = []
        for j, message in enumerate(prompts):
            ids = _chat_ids(tok, message)
            for r in range(spec["rounds"]):
                turn = names[i % len(names) :] + names[: i % len(names)]
                i += 1
                got = _side_by_side(
                    {n: engines[n] for n in turn}, ids, spec["max_tokens"], f"{load}-{j}-{r}"
                )
                row: dict[str, Any] = {
                    "prompt": j,
                    "prompt_tokens": len(ids),
                    "output_tokens": len(got["on"]["tokens"]),
                    "same_output": all(got[n]["tokens"] == got["off"]["tokens"] for n in names),
                }
                for name in names:
                    row.update({f"{k}_{name}": v for k, v in got[name].items() if k != "tokens"})
                rows.append(row)
        result["loads"][load] = {"requests": rows, **_totals(rows, names)}
    return result


def _totals(rows: list[dict], names: list[str]) -> dict[str, float]:
    out = sum(r["output_tokens"] for r in rows)
    proposed = sum(r["proposed_on"] for r in rows)
    accepted = sum(r["accepted_on"] for r in rows)
    totals: dict[str, float] = {
        "output_tokens": out,
        "acceptance": accepted / proposed if proposed else 0.0,
        "proposed": proposed,
        "accepted": accepted,
        "all_same_output": all(r["same_output"] for r in rows),
    }
    for name in names:
        wall = sum(r[f"wall_s_{name}"] for r in rows)
        decode = sum(r[f"wall_s_{name}"] - r[f"ttft_s_{name}"] for r in rows)
        steps = sum(r[f"steps_{name}"] for r in rows)
        totals[f"tok_s_{name}"] = out / wall
        totals[f"decode_tok_s_{name}"] = (out - len(rows)) / decode
        totals[f"tokens_per_step_{name}"] = (out - len(rows)) / max(1, steps - len(rows))
    for name in names:
        totals[f"ratio_{name}"] = totals[f"tok_s_{name}"] / totals["tok_s_off"]
    totals["ratio"] = totals["tok_s_on"] / totals["tok_s_off"]
    totals["decode_ratio"] = totals["decode_tok_s_on"] / totals["decode_tok_s_off"]
    totals["median_request_ratio"] = statistics.median(
        (r["wall_s_off"] / r["wall_s_on"]) for r in rows
    )
    return totals


def speculative_spec(
    model_dir: Path | None, dtype: str, quick: bool, workspace: bool = False
) -> dict[str, Any]:
    """The child's spec for one dtype (`run_speculative`). `workspace`: instead, free chat
    (where speculation comes and goes most) off, on, and on with no decode workspace."""
    loads = workloads(quick)
    return {
        "ckpt": str(model_dir) if model_dir is not None else None,
        "dtype": dtype,
        "num_tokens": 4,
        "loads": {"chat": loads["chat"]} if workspace else loads,
        "variants": ["off", "on", "on_no_workspace"] if workspace else ["off", "on"],
        "rounds": 1,
        "max_tokens": 32 if quick else 256,
    }


def speculative_section(result: dict[str, Any], dtype: str) -> list[str]:
    """The table: per load, acceptance, tokens per step and tok/s off and on."""
    rows = []
    for load, r in result["loads"].items():
        rows.append(
            {
                "load": {"copy": "copy-heavy", "chat": "free chat"}.get(load, load),
                "requests": len(r["requests"]),
                "acceptance": f"{100 * r['acceptance']:.0f}%",
                "tokens_per_step": r["tokens_per_step_on"],
                "tok_s_off": r["tok_s_off"],
                "tok_s_on": r["tok_s_on"],
                "ratio": f"{r['ratio']:.2f}x",
                "decode_ratio": f"{r['decode_ratio']:.2f}x",
                "same": "yes" if r["all_same_output"] else "NO",
            }
        )
    cols = [
        ("load", "load"),
        ("requests", "requests"),
        ("acceptance", "drafts kept"),
        ("tokens_per_step", "tokens / step"),
        ("tok_s_off", "tok/s off"),
        ("tok_s_on", "tok/s n-gram"),
        ("ratio", "ratio"),
        ("decode_ratio", "ratio after 1st token"),
        ("same", "same output"),
    ]
    copy, chat = result["loads"].get("copy"), result["loads"].get("chat")
    verdict = []
    if copy is not None:
        verdict.append(f"copy-heavy {copy['ratio']:.2f}x (target >= 1.5x)")
    if chat is not None:
        verdict.append(f"free chat {chat['ratio']:.2f}x (target >= 0.95x)")
    for load, r in result["loads"].items():
        if "tok_s_on_no_workspace" in r:
            verdict.append(
                f"{load}: speculation with no decode workspace {r['tok_s_on_no_workspace']:.2f} "
                f"tok/s ({r['ratio_on_no_workspace']:.2f}x) against {r['tok_s_on']:.2f} "
                f"({r['ratio']:.2f}x) with it (a verify step drops the request's row, gathered "
                "again at its next plain decode)"
            )
    return [
        f"\n### Speculative decoding (n-gram, k = 4), c = 1, {Path(result['model']).name}, "
        f"{dtype}\n",
        "Greedy, one request at a time; speculation off and on side by side in one process, "
        "step by step in turn. tok/s: output tokens over request time (prefill included).\n",
        markdown_table(rows, cols),
        "\n" + "; ".join(verdict) + ".",
    ]
