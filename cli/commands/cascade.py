"""`switchyard cascade …`: train, evaluate and exercise the difficulty classifier.

Imports happen inside the command functions so `switchyard --help` stays fast.
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _cmd_train(args: argparse.Namespace) -> int:
    from cascade.data import DatasetError, load_dataset
    from cascade.model import TrainConfig
    from cascade.train import train_classifier

    try:
        datasets = [load_dataset(d) for d in args.data]
        tenant = load_dataset(args.adapt) if args.adapt else None
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if tenant is not None:
        return _train_adapted(args, datasets, tenant)
    from cascade.adapt import merge_datasets

    dataset = merge_datasets(datasets)
    manifest = train_classifier(
        dataset,
        Path(args.out),
        TrainConfig.quick(args.seed) if args.quick else TrainConfig(seed=args.seed),
        name=args.name,
        num_reference=args.num_reference,
    )
    ref = manifest["metrics"].get("reference_sample")
    print(f"wrote {args.out} ({manifest['vocabulary_size']} terms, {manifest['hyperparameters']})")
    if ref:
        print(
            f"reference sample (random, optimistic): APGR classifier "
            f"{ref['classifier']['apgr']:.3f}, prompt length {ref['prompt_length']['apgr']:.3f}"
        )
    return 0


def _train_adapted(args: argparse.Namespace, datasets: list, tenant) -> int:  # noqa: ANN001
    from cascade.adapt import AdaptConfig, merge_datasets, train_adapted

    config = AdaptConfig.quick(args.seed) if args.quick else AdaptConfig(seed=args.seed)
    try:
        manifest = train_adapted(
            merge_datasets(datasets), tenant, Path(args.out), config, args.name
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    a = manifest["adaptation"]
    print(
        f"wrote {args.out}: {a['num_labels']} tenant labels weighted x{a['tenant_weight']:g}, "
        f"length prior x{a['prior_weight']:g}; tenant inner-fold APGR {a['tenant_oof_apgr']:.3f} "
        f"(prompt length {a['tenant_prompt_length_apgr']:.3f})"
    )
    return 0


def _admin(args: argparse.Namespace):  # noqa: ANN201
    """(base URL, headers) of the gateway's admin API, as `switchyard admin` finds them."""
    import os

    from cli.commands.models import cache_dir
    from cli.serve.state import local_admin_key, local_stack

    stack = local_stack(cache_dir(None))
    url = (args.url or (stack["url"] if stack else "http://127.0.0.1:8000")).rstrip("/")
    key = (
        args.admin_key
        or os.environ.get("SWITCHYARD_ADMIN_KEY")
        or local_admin_key(cache_dir(None), url)
    )
    if not key:
        raise SystemExit(
            f"error: no admin key for {url}: give --admin-key or set SWITCHYARD_ADMIN_KEY"
        )
    return url, {"authorization": f"Bearer {key}", "x-admin-user": args.who}


def _export_labels(args: argparse.Namespace, out: Path) -> dict:
    import json

    import httpx

    url, headers = _admin(args)
    r = httpx.get(
        f"{url}/admin/routing/labels/{args.tenant}",
        params={"split": args.split},
        headers=headers,
        timeout=120,
    )
    if r.status_code != 200:
        raise SystemExit(f"error: {r.status_code} {r.text}")
    doc = r.json()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for row in doc["rows"]:
            fh.write(json.dumps(row) + "\n")
    print(
        f"{len(doc['rows'])} labels of {args.tenant} ({args.split}) -> {out}; "
        f"left out {doc['skipped']} of {doc['num_labels']}",
        file=sys.stderr,
    )
    return doc


def _cmd_export_labels(args: argparse.Namespace) -> int:
    _export_labels(args, Path(args.out))
    return 0


def _promote(args: argparse.Namespace, artifact: Path) -> int:
    import base64
    import json

    import httpx

    from cascade.artifact import ArtifactError
    from gateway.learning.classifiers import read_artifact_files

    url, headers = _admin(args)
    try:
        files = read_artifact_files(artifact)
    except ArtifactError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    body = {
        "files": {k: base64.b64encode(v).decode() for k, v in files.items()},
        "force": args.force,
    }
    r = httpx.put(
        f"{url}/admin/routing/classifiers/{args.tenant}", json=body, headers=headers, timeout=120
    )
    doc = r.json()
    print(json.dumps(doc.get("figures", doc), indent=2))
    if r.status_code == 200:
        print(f"promoted: {args.tenant} now routes with version {doc['current']}")
        return 0
    print(f"not promoted ({r.status_code}): {doc.get('error', {}).get('message')}")
    return 3


def _cmd_promote(args: argparse.Namespace) -> int:
    if args.version is None:
        return _promote(args, Path(args.artifact))
    import json

    import httpx

    url, headers = _admin(args)
    body = {"version": args.version, "force": args.force}
    r = httpx.put(
        f"{url}/admin/routing/classifiers/{args.tenant}", json=body, headers=headers, timeout=120
    )
    print(json.dumps(r.json(), indent=2))
    return 0 if r.status_code == 200 else 3


def _cmd_rollback(args: argparse.Namespace) -> int:
    import json

    import httpx

    url, headers = _admin(args)
    r = httpx.post(f"{url}/admin/routing/classifiers/{args.tenant}/rollback", headers=headers)
    print(json.dumps(r.json(), indent=2))
    return 0 if r.status_code == 200 else 1


def _cmd_retrain(args: argparse.Namespace) -> int:
    """export-labels (training split), train --adapt, promote: one command."""
    from cascade.adapt import AdaptConfig, merge_datasets, train_adapted
    from cascade.data import DatasetError, load_dataset

    out = Path(args.out)
    args.split = "train"
    _export_labels(args, out / "labels.jsonl")
    try:
        base = merge_datasets([load_dataset(d) for d in args.data])
        tenant = load_dataset(out / "labels.jsonl")
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = AdaptConfig.quick(args.seed) if args.quick else AdaptConfig(seed=args.seed)
    version = time.strftime("%Y%m%dT%H%M%S")
    artifact = out / f"{args.tenant}-{version}"
    try:
        train_adapted(base, tenant, artifact, config, f"{args.tenant}-{version}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _promote(args, artifact)


def _latency(classifier: str | None, views: list, num: int) -> dict:
    from cascade.bench import measure_scoring_latency
    from cascade.classifier import load_scorer

    scorer, fell_back = load_scorer(classifier)
    report = measure_scoring_latency(scorer, views[:num]).as_dict()
    return {**report, "fell_back": fell_back}


def _cmd_eval(args: argparse.Namespace) -> int:
    from cascade.data import DatasetError, load_dataset
    from cascade.evaluate import evaluate_dataset, method_notes
    from cascade.model import TrainConfig
    from cascade.report import render_markdown, write_report

    try:
        dataset = load_dataset(args.data)
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = TrainConfig.quick(args.seed) if args.quick else TrainConfig(seed=args.seed)
    report = evaluate_dataset(dataset, config, args.folds, args.random_folds, args.n_jobs)
    report["notes"] = method_notes(config)
    if args.bench_prompts:
        from cascade.bench import synthetic_prompts
        from cascade.features import request_view

        views = [e.view for e in dataset.examples]
        synthetic = [request_view(p) for p in synthetic_prompts(args.bench_prompts)]
        report["latency"] = {
            "dataset": _latency(args.classifier, views, args.bench_prompts),
            "synthetic, 5-800 words": _latency(args.classifier, synthetic, args.bench_prompts),
        }
    if args.out:
        write_report(report, Path(args.out))
    print(render_markdown(report).split("## Calibration")[0])
    return 0


def _read_requests(stream) -> list[tuple[int, dict | None, str | None]]:
    import json

    out: list[tuple[int, dict | None, str | None]] = []
    for num, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            out.append((num, None, f"line {num}: bad JSON: {exc.msg}"))
            continue
        ok = isinstance(obj, dict) and (
            isinstance(obj.get("prompt"), str) or isinstance(obj.get("messages"), list)
        )
        out.append((num, obj, None) if ok else (num, None, f"line {num}: needs prompt or messages"))
    return out


def _cmd_score(args: argparse.Namespace) -> int:
    import json

    from cascade.classifier import load_scorer

    scorer, fell_back = load_scorer(args.classifier)
    num_errors = 0
    for _, obj, error in _read_requests(sys.stdin):
        if obj is None:
            num_errors += 1
            print(json.dumps({"error": error}))
            continue
        prompt = obj.get("prompt") if isinstance(obj.get("prompt"), str) else ""
        messages = obj.get("messages") if isinstance(obj.get("messages"), list) else None
        max_tokens = obj.get("max_tokens") if isinstance(obj.get("max_tokens"), int) else None
        out = {"score": round(scorer.score(prompt, messages, max_tokens), 6)}
        out |= {"fallback": fell_back, "scorer": scorer.name}
        if "id" in obj:
            out = {"id": obj["id"], **out}
        if args.explain:
            out["explain"] = scorer.explain(prompt, messages, max_tokens, top=args.explain)
        print(json.dumps(out))
    return 1 if num_errors else 0


def _cmd_bench_score(args: argparse.Namespace) -> int:
    import json

    from cascade.bench import synthetic_prompts
    from cascade.features import request_view

    if args.data:
        from cascade.data import load_dataset

        views = [e.view for e in load_dataset(args.data).examples]
    else:
        views = [request_view(p) for p in synthetic_prompts(args.num)]
    report = _latency(args.classifier, views, args.num)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


def _cmd_eval_adapt(args: argparse.Namespace) -> int:
    import json

    from cascade.adapt import AdaptConfig
    from cascade.adapt_eval import render_summary, simulate
    from cascade.data import DatasetError, load_dataset

    try:
        dataset = load_dataset(args.data)
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = AdaptConfig.quick() if args.quick else AdaptConfig()
    report = simulate(
        dataset,
        seeds=args.seeds,
        subjects_per_domain=args.subjects_per_domain,
        sizes=args.sizes,
        max_domains=args.max_domains,
        config=config,
    )
    table = render_summary(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "adapt.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        (out / "adapt.md").write_text(table + "\n", encoding="utf-8")
    print(table)
    return 0


def _cmd_check_default(args: argparse.Namespace) -> int:
    import json

    from cascade.data import load_dataset
    from cascade.model import TrainConfig
    from cascade.ood_check import check_default

    config = TrainConfig(seed=args.seed)
    if args.prior_weights:
        config.prior_weights = tuple(args.prior_weights)
    report = check_default(load_dataset(args.data), config)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


# The `cascade` action -> its handler.
ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": _cmd_train,
    "eval": _cmd_eval,
    "eval-adapt": _cmd_eval_adapt,
    "export-labels": _cmd_export_labels,
    "promote": _cmd_promote,
    "rollback": _cmd_rollback,
    "retrain": _cmd_retrain,
    "check-default": _cmd_check_default,
    "score": _cmd_score,
    "bench-score": _cmd_bench_score,
}


def run(args: argparse.Namespace) -> int:
    return ACTIONS[args.action](args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `cascade` and one parser per action (the keys of ACTIONS)."""
    cascade = subparsers.add_parser("cascade", help="the difficulty classifier of the router")
    cascade.set_defaults(run=run)
    sub = cascade.add_subparsers(dest="action", required=True)
    data_help = "CSV/JSONL of (prompt, weak_ok, strong_ok[, group]) or a directory of them"
    clf_help = "classifier artifact directory (default: the shipped difficulty-v1)"

    tr = sub.add_parser("train", help="train the classifier and write its artifact")
    tr.add_argument("--data", required=True, action="append", help=data_help + " (repeatable)")
    tr.add_argument(
        "--adapt",
        default=None,
        help="a tenant's labels (JSONL of prompt, weak_ok, strong_ok[, group]), weighted up "
        "by a factor chosen on inner folds of them (see export-labels)",
    )
    tr.add_argument("--out", required=True, help="artifact directory to write")
    tr.add_argument("--name", default=None, help="artifact name (default: the directory name)")
    tr.add_argument("--num-reference", type=int, default=1000, help="held-out reference sample")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--quick", action="store_true", help="tiny search: a smoke run, not to ship")

    ev = sub.add_parser("eval", help="grouped and random CV: cost-quality curves, APGR, CPT")
    ev.add_argument("--data", required=True, help=data_help)
    ev.add_argument("--out", default=None, help="report directory (report.md/json, curve.png)")
    ev.add_argument("--folds", type=int, default=5, help="GroupKFold folds (0: skip)")
    ev.add_argument("--random-folds", type=int, default=5, help="random KFold folds (0: skip)")
    ev.add_argument("--classifier", default=None, help=clf_help + "; timed for latency")
    ev.add_argument("--bench-prompts", type=int, default=3000, help="prompts timed (0: skip)")
    ev.add_argument("--n-jobs", type=int, default=1, help="folds trained in parallel")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--quick", action="store_true", help="tiny search: a smoke run")

    ea = sub.add_parser(
        "eval-adapt", help="adaptation simulation: subjects held out as tenant domains"
    )
    ea.add_argument("--data", required=True, help=data_help)
    ea.add_argument("--out", default=None, help="directory for adapt.json and adapt.md")
    ea.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ea.add_argument("--subjects-per-domain", type=int, default=8)
    ea.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 1000])
    ea.add_argument("--max-domains", type=int, default=None, help="per seed (default: all)")
    ea.add_argument("--quick", action="store_true", help="tiny search: a smoke run")

    def gateway_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--tenant", required=True)
        p.add_argument("--url", default=None, help="the gateway (default: local serve; :8000)")
        p.add_argument("--admin-key", default=None, help="default: $SWITCHYARD_ADMIN_KEY")
        p.add_argument("--who", default="cli", help="who the audit log records")

    el = sub.add_parser("export-labels", help="a tenant's labels from Redis, as training JSONL")
    gateway_args(el)
    el.add_argument("--out", required=True, help="JSONL file to write")
    el.add_argument("--split", choices=("train", "holdout", "all"), default="train")

    pr = sub.add_parser("promote", help="upload a tenant's classifier; checked on held-out labels")
    gateway_args(pr)
    what = pr.add_mutually_exclusive_group(required=True)
    what.add_argument("--artifact", help="artifact directory to upload")
    what.add_argument("--version", type=int, help="a version stored before (roll forward/back)")
    pr.add_argument("--force", action="store_true", help="skip the held-out check (audited)")

    rb = sub.add_parser("rollback", help="a tenant back to its previous classifier")
    gateway_args(rb)

    rt = sub.add_parser("retrain", help="export-labels + train --adapt + promote, for one tenant")
    gateway_args(rt)
    rt.add_argument("--data", required=True, action="append", help=data_help + " (base data)")
    rt.add_argument("--out", required=True, help="working directory (labels, artifact)")
    rt.add_argument("--force", action="store_true", help="promote even if not better (audited)")
    rt.add_argument("--seed", type=int, default=0)
    rt.add_argument("--quick", action="store_true", help="tiny search: tests and smoke runs")

    cd = sub.add_parser(
        "check-default", help="the shipped procedure vs length on subjects held out of tuning"
    )
    cd.add_argument("--data", required=True, help=data_help)
    cd.add_argument("--out", default=None, help="also write the JSON here")
    cd.add_argument("--prior-weights", type=float, nargs="+", default=None)
    cd.add_argument("--seed", type=int, default=0)

    sc = sub.add_parser("score", help='score JSONL on stdin: {"prompt"} or {"messages"}')
    sc.add_argument("--classifier", default=None, help=clf_help)
    sc.add_argument("--explain", type=int, default=0, help="add the top N feature contributions")

    bs = sub.add_parser("bench-score", help="scoring latency p50/p99 on one core")
    bs.add_argument("--classifier", default=None, help=clf_help)
    bs.add_argument("--data", default=None, help=data_help + " (default: synthetic prompts)")
    bs.add_argument("--num", type=int, default=3000, help="prompts to time")
    bs.add_argument("--out", default=None, help="also write the JSON here")
