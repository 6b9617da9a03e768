"""The engine: a scheduler, a KV manager and a model runner, stepped in one thread."""

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvcache import KVCacheManager
from workers.engine.config import EngineConfig
from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.isolation import execute_isolated
from workers.engine.outputs import Completion, RequestOutput, TokenLogprobs
from workers.engine.request import FinishReason, Request, RequestStatus
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.speculative import num_speculative_tokens, propose_ngram, token_bytes
from workers.engine.stats import EngineStats
from workers.engine.step_model import StepModel
from workers.engine.structured import GrammarCompiler, GrammarSpec, Guide
from workers.engine.tokenizer import CheckpointTokenizer
from workers.errors import ContextLengthError, EngineStepError, InvalidRequestError
from workers.runner.runner import ModelRunner, SampledToken

log = logging.getLogger(__name__)

# Steps in a row in which every scheduled request failed, alone, before the failure is
# taken for the engine's own (a broken device) rather than the requests'.
MAX_FAILED_STEPS = 3


class LLMEngine:
    """Single-threaded engine. `AsyncEngine` runs one in its own thread for servers."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: CheckpointTokenizer | None,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert config.scheduler is not None
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.clock = clock
        self.kv = KVCacheManager(
            runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        sched = config.scheduler
        if sched.attention_parity_context is None:
            parity = max(1, runner.model_config.attention_parity_context // 2)
            sched = replace(sched, attention_parity_context=parity)
        self.step_model = StepModel()
        self.scheduler = Scheduler(sched, self.kv, clock, self.step_model)
        self.max_model_len = min(runner.max_model_len, runner.kv_capacity_tokens)
        eos = tokenizer.eos_token_ids if tokenizer else runner.model_config.eos_token_ids
        self.eos_token_ids: tuple[int, ...] = eos
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self.num_failed_requests = 0
        self._num_failed_steps = 0  # in a row, every request failing
        # Speculative decoding: drafts verified, and of those the ones the target agreed with.
        self.num_spec_proposed_tokens = 0
        self.num_spec_accepted_tokens = 0
        # Proposals need every rank to run a verify chunk alike; a shard group does not yet.
        self.speculative = config.speculative if runner.shard is None else None
        # Wall seconds of the steps that ran a batch, from scheduling to the sampled tokens
        # (the output bookkeeping after is not in it): what the requests' `prefill_s` and
        # `decode_s` shares divide, so they sum to it.
        self.step_time_s = 0.0
        self.grammars: GrammarCompiler | None = (
            GrammarCompiler(tokenizer.hf, runner.model_config.vocab_size, eos, config.grammar_cache)
            if tokenizer is not None
            else None
        )
        # n > 1: samples held back until the sample they fork from has its prompt KV.
        self._held: dict[str, list[Request]] = {}
        # Called in `step` once the batch is scheduled, before the model runs (AsyncEngine
        # publishes its stats there, so a long step shows the batch it is running).
        self.on_scheduled: Callable[[], None] | None = None

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> "LLMEngine":
        """Load a local Hugging Face directory (a tokenizer is optional)."""
        model_dir = Path(model_dir)
        config = config or EngineConfig()
        runner = ModelRunner(model_dir, config)
        has_tok = (model_dir / "tokenizer.json").is_file()
        tokenizer = CheckpointTokenizer(model_dir) if has_tok else None
        return cls(runner, tokenizer, config, clock)

    # -- requests ---------------------------------------------------------------------

    def make_request(
        self,
        request_id: str | None = None,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
        tenant: str | None = None,
        cache_salt: str | None = None,
        deadline: float | None = None,
        add_special_tokens: bool = True,
        grammar: GrammarSpec | None = None,
        guide: Guide | None = None,
        resume_token_ids: Sequence[int] | None = None,
        resume_text_chars: int = 0,
    ) -> Request:
        """Validate and tokenize a request. Touches no engine state, so any thread may call it.

        `resume_token_ids`: the output another replica generated before it failed; the
        request continues after it exactly as that one would have (prefilled as prompt plus
        output, a seeded generator advanced past their draws, stop strings and `max_tokens`
        counted over the whole output), and its text is not handed out again but for what
        lies past the first `resume_text_chars` characters (the client has those; the rest
        was held back by the other replica's detokenizer). A grammar's matcher is advanced
        over it (InvalidRequestError when the output does not match).

        A prompt rendered by the chat template already holds its special tokens (BOS
        included, where the template writes it): pass `add_special_tokens=False`.
        `grammar`: the output must match it (compiled here, once per tenant and schema;
        GrammarBusyError when the tenant has its bound of compiles in flight). `guide`:
        instead, a guide the caller got from `self.grammars` itself.
        `tenant`: whose work it is (the scheduler shares each step's prefill budget fairly
        between tenants; None: anonymous).
        """
        params = params or SamplingParams()
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("give exactly one of prompt and prompt_token_ids", "prompt")
        if prompt is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send token ids", "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens)
        else:
            ids = list(prompt_token_ids or [])
            vocab = self.runner.model_config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab})", "prompt"
                )
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthError(len(ids), params.max_tokens, self.max_model_len)
        vocab = self.runner.model_config.vocab_size
        if any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError(
                f"logit_bias keys must be token ids below {vocab}", "logit_bias"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer", "stop")
        if grammar is not None and guide is None:
            if self.grammars is None:
                raise InvalidRequestError("structured outputs need a tokenizer", grammar.param)
            guide = self.grammars.guide(grammar, tenant)
        resumed = list(resume_token_ids or [])
        resumed_text = ""
        if resumed:
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in resumed):
                raise InvalidRequestError(
                    f"resume token ids must be integers in [0, {vocab})", "resume_token_ids"
                )
            if len(resumed) >= params.max_tokens:
                raise InvalidRequestError(
                    "resume_token_ids must be fewer than max_tokens", "resume_token_ids"
                )
            if resume_text_chars < 0:
                raise InvalidRequestError("resume_text_chars must be >= 0", "resume_text_chars")
            if self.tokenizer is not None:  # the text handed out is a prefix of its text
                probe = IncrementalDetokenizer(
                    self.tokenizer.backend, ids, params.stop, params.skip_special_tokens
                )
                try:
                    probe.prime(resumed, resume_text_chars)
                except ValueError as exc:
                    raise InvalidRequestError(str(exc), "resume_text_chars") from None
                resumed_text = probe.text[:resume_text_chars]
            if guide is not None:  # the matcher goes on from where the output is
                for i, t in enumerate(resumed):
                    if not guide.accept(t):
                        why = guide.error or f"token {t} at {i} breaks it"
                        raise InvalidRequestError(
                            f"the resumed output does not match the request's grammar: {why}",
                            "resume_token_ids",
                        )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(
            rid,
            ids,
            params,
            arrival_time=self.clock(),
            priority=priority,
            tenant=tenant,
            deadline=deadline,
            cache_salt=cache_salt,
            eos_token_ids=self.eos_token_ids,
        )
        request.guide = guide
        if resumed:
            request.output_token_ids = resumed
            request.all_token_ids.extend(resumed)
            request.resumed_chars = resume_text_chars
            request.resumed_text = resumed_text
        return request

    def fork(self, parent: Request, request_id: str, seed: int | None) -> Request:
        """Another sample of `parent`'s prompt (n > 1): same prompt, params and salt, its
        own seed. Added after the parent, it waits for the parent's prefill and then takes
        the prompt's blocks from the prefix cache (only the last partial block is
        recomputed)."""
        child = Request(
            request_id,
            parent.prompt_token_ids,
            replace(parent.params, seed=seed),
            arrival_time=parent.arrival_time,
            priority=parent.priority,
            tenant=parent.tenant,
            deadline=parent.deadline,
            cache_salt=parent.cache_salt,
            eos_token_ids=parent.eos_token_ids,
        )
        if parent.guide is not None:
            child.guide = type(parent.guide)(parent.guide.pristine, parent.guide.compiler)
        child.fork_of = parent.request_id
        return child

    def add(self, request: Request) -> RequestOutput | None:
        """Queue a request. None when queued; a finished output with `error` when not."""
        try:
            parent = self.scheduler.requests.get(request.fork_of or "")
            if parent is not None and parent.num_output_tokens == 0:
                self._held.setdefault(parent.request_id, []).append(request)
            else:
                self.scheduler.add(request)
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer.backend,
                    request.prompt_token_ids,
                    request.params.stop,
                    request.params.skip_special_tokens,
                )
                if request.num_output_tokens:  # resumed: its text so far, not handed out
                    detok.prime(request.output_token_ids, request.resumed_chars)
                self._detok[request.request_id] = detok
        except Exception as exc:
            return self._fail(request, exc, "add")
        return None

    def add_request(self, request_id: str | None = None, **kwargs: Any) -> Request:
        request = self.make_request(request_id, **kwargs)
        self.add(request)
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request; its blocks are free when this returns. None if unknown."""
        req = self.scheduler.abort(request_id)
        if req is None:
            req = self._unhold(request_id)
            if req is None:
                return None
            req.status = RequestStatus.FINISHED
            req.finish_reason = FinishReason.ABORT
        self._release_forks()
        return self._output(req, [], None)

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Work run inside is not counted: the engine's own counters (tokens, failures,
        failed steps in a row) and the prefix cache's are put back as they were on the way
        out, however it ends. For the engine's own synthetic work (start-up calibration)."""
        saved = (
            self.num_generated_tokens,
            self.num_prompt_tokens_computed,
            self.num_failed_requests,
            self._num_failed_steps,
            self.step_time_s,
            self.num_spec_proposed_tokens,
            self.num_spec_accepted_tokens,
            replace(self.kv.stats),
        )
        try:
            yield
        finally:
            (
                self.num_generated_tokens,
                self.num_prompt_tokens_computed,
                self.num_failed_requests,
                self._num_failed_steps,
                self.step_time_s,
                self.num_spec_proposed_tokens,
                self.num_spec_accepted_tokens,
                self.kv.stats,
            ) = saved

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._held)

    def _unhold(self, request_id: str) -> Request | None:
        for parent_id, held in self._held.items():
            for req in held:
                if req.request_id == request_id:
                    held.remove(req)
                    if not held:
                        del self._held[parent_id]
                    return req
        return None

    def _release_forks(self) -> None:
        """Queue held samples whose parent has its prompt KV (or is gone)."""
        if not self._held:
            return
        for parent_id in list(self._held):
            parent = self.scheduler.requests.get(parent_id)
            if parent is None or parent.num_output_tokens > 0:
                for req in self._held.pop(parent_id):
                    self.scheduler.add(req)

    # -- the step ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report what changed.

        A request that makes the step fail is failed alone (an output with `error`) and
        the others go on; raises EngineStepError only for a failure no request explains.
        """
        sched = self.scheduler
        started = time.perf_counter()
        self._release_forks()
        self._propose()
        out = sched.schedule()
        outputs = [self._output(req, [], None) for req in out.expired]
        if not out.scheduled:
            return outputs
        if self.on_scheduled is not None:
            self.on_scheduled()
        num_seqs, num_tokens = len(out.scheduled), out.num_scheduled_tokens
        context = sum(req.num_computed_tokens + n for req, n in out.scheduled)
        tables = {req.request_id: self.kv.block_table(req.request_id) for req, _ in out.scheduled}
        sampled, failed = execute_isolated(
            lambda batch: self.runner.execute(batch, tables), out.scheduled
        )
        # Each scheduled request's share of the step's time, before `advance` (the tokens'
        # positions say prefill or decode) and before any output is built (a finished or
        # failed request's last output carries this step too). Every request pays for the
        # steps it was in and nothing more: a failed one for the step it failed in; a
        # preempted one for its recompute too (prefill: its prompt and output so far
        # computed again), as it was in those steps; an n > 1 fork for its own chunk (the
        # prompt's blocks it took from the prefix cache cost it nothing); a resumed one for
        # prefilling its prompt and the output it resumes from.
        wall_s = time.perf_counter() - started
        self.step_time_s += wall_s
        per_token_s = wall_s / num_tokens
        for req, n in out.scheduled:
            if req.num_computed_tokens < req.num_prefill_tokens:
                req.prefill_s += n * per_token_s
            else:
                req.decode_s += n * per_token_s
        self._count_failed_step(len(failed), len(out.scheduled), failed)
        outputs += [self._fail(req, exc, "step") for req, exc in failed]
        out.scheduled = [(req, n) for req, n in out.scheduled if not req.is_finished]
        num_drafts = sum(req.num_draft_tokens(n) for req, n in out.scheduled)
        sched.advance(out)
        self.num_prompt_tokens_computed += (
            sum(n for _, n in out.scheduled) - num_drafts - len(sampled)
        )
        now = self.clock()
        for req, _ in out.scheduled:
            token = sampled.get(req.request_id)
            drafts, req.spec_token_ids = req.spec_token_ids, []
            if token is None:
                continue
            self.num_spec_proposed_tokens += len(drafts)
            self.num_spec_accepted_tokens += len(token.accepted)
            try:
                self._append(req, token, now, outputs)
            except Exception as exc:  # stop checks, detokenization: this request only
                outputs.append(self._fail(req, exc, "detokenize"))
        self.step_model.observe(num_seqs, num_tokens, context, time.perf_counter() - started)
        return outputs

    def _append(
        self, req: Request, token: SampledToken, now: float, outputs: list[RequestOutput]
    ) -> None:
        """Append a step's tokens (a verify step's kept drafts, then its next token) until
        one finishes the request, with an output for each: one token an output, as without
        speculation (a stream's chunk is a token; the gateway counts them so). A kept
        draft's KV, computed in the verify step, becomes the request's as it is appended
        (`Scheduler.accept_draft`)."""
        token_ids = [*token.accepted, token.token_id]
        for i, token_id in enumerate(token_ids):
            req.append_token(token_id)
            if req.guide is not None and not req.guide.accept(token_id):
                why = req.guide.error or f"token {token_id} breaks it"
                raise RuntimeError(f"the request's grammar failed: {why}")
            self.num_generated_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            self._check_stop(req, token_id)
            last = req.is_finished or i == len(token_ids) - 1
            lps = [token.logprobs] if last and token.logprobs is not None else None
            outputs.append(self._output(req, [token_id], lps))
            if last:
                return
            self.scheduler.accept_draft(req)

    def _propose(self) -> None:
        """Speculative decoding: drafts for each running decode that may have them (n-gram
        prompt lookup over its prompt and output so far); the scheduler trims them to its
        budget and KV, the runner verifies them (`workers.engine.speculative`)."""
        spec = self.speculative
        if spec is None or spec.method == "none":
            return
        for req in self.scheduler.running:
            req.spec_token_ids = []
            if req.num_tokens - req.num_computed_tokens != 1:
                continue  # a prefill chunk
            k = num_speculative_tokens(req, spec, self.max_model_len)
            if k:
                req.spec_haystack = token_bytes(req.all_token_ids, req.spec_haystack)
                req.spec_token_ids = propose_ngram(
                    req.all_token_ids, k, spec.min_ngram, spec.max_ngram, req.spec_haystack
                )

    def stats(self, now: float) -> EngineStats:
        """A snapshot for other threads, taken at `now`; only the engine's thread calls it."""
        sched, kv = self.scheduler, self.kv
        seats = sched.seats()
        decode_step_s, prefill_per_s = self._capacity(seats)
        return EngineStats(
            time_s=now,
            num_steps=sched.step_count,
            num_running=len(sched.running),
            waiting_tokens=tuple([r.num_tokens - r.num_computed_tokens for r in sched.waiting]),
            num_held=sum(map(len, self._held.values())) if self._held else 0,
            max_num_seqs=sched.config.max_num_seqs,
            block_size=kv.block_size,
            kv_blocks_used=kv.pool.num_used_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_blocks_total=kv.num_total_blocks,
            prefix_cache_query_tokens=kv.stats.num_query_tokens,
            prefix_cache_hit_tokens=kv.stats.num_hit_tokens,
            num_preemptions=sched.num_preemptions,
            num_failed_requests=self.num_failed_requests,
            num_generated_tokens=self.num_generated_tokens,
            num_spec_proposed_tokens=self.num_spec_proposed_tokens,
            num_spec_accepted_tokens=self.num_spec_accepted_tokens,
            seats=seats,
            itl_target_s=sched.config.itl_target_s,
            step_fit=self.step_model.fit,
            decode_step_s=decode_step_s,
            prefill_tokens_per_s=prefill_per_s,
            recent_step_s=self.step_model.recent_step_s(),
            running_remaining=tuple(
                [r.params.max_tokens - r.num_output_tokens for r in sched.running]
            ),
            waiting_max_tokens=tuple([r.params.max_tokens for r in sched.waiting]),
            running_prefill_tokens=sum(
                [max(0, r.num_tokens - r.num_computed_tokens - 1) for r in sched.running]
            ),
        )

    def _capacity(self, seats: int) -> tuple[float | None, float | None]:
        """(seconds a decode step takes with `seats` sequences, prompt tokens per second a
        step computes beside the running batch), from the step model; (None, None) until
        it has learned."""
        fit = self.step_model.fit
        if fit is None:
            return None, None
        context_per_seq = self.step_model.context_per_seq()
        decode_s = fit.predict(seats, seats, round(seats * context_per_seq))
        running = self.scheduler.running
        budget = self.scheduler.token_budget()
        context = sum(r.num_computed_tokens for r in running)
        step_s = fit.predict(len(running) + 1, budget, context)
        prefill_tokens = max(1, budget - len(running))
        return decode_s, (prefill_tokens / step_s if step_s > 0 else None)

    def _count_failed_step(
        self, num_failed: int, num_scheduled: int, failed: list[tuple[Request, Exception]]
    ) -> None:
        if num_failed < num_scheduled:
            self._num_failed_steps = 0
            return
        self._num_failed_steps += 1
        if num_scheduled > 1 or self._num_failed_steps >= MAX_FAILED_STEPS:
            raise EngineStepError(
                f"every request failed alone ({num_scheduled} this step, "
                f"{self._num_failed_steps} such steps in a row): {failed[0][1]!r}"
            ) from failed[0][1]

    def _fail(self, req: Request, exc: Exception, phase: str) -> RequestOutput:
        """Finish one request with an error; its blocks are free when this returns."""
        log.error("request %s failed (%s): %r", req.request_id, phase, exc, exc_info=exc)
        if self.scheduler.requests.get(req.request_id) is req:
            self.scheduler.finish(req, FinishReason.ERROR)
        else:  # never queued: its id may belong to another request
            req.status = RequestStatus.FINISHED
            req.finish_reason = FinishReason.ERROR
        self._detok.pop(req.request_id, None)
        self.num_failed_requests += 1
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=FinishReason.ERROR,
            stop_reason=None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=f"{type(exc).__name__}: {exc}",
            prefill_s=req.prefill_s,
            decode_s=req.decode_s,
        )

    def _check_stop(self, req: Request, token_id: int) -> None:
        params = req.params
        detok = self._detok.get(req.request_id)
        past_min = req.num_output_tokens > params.min_tokens or req.guide is not None
        if detok is not None:
            detok.push(token_id, check_stops=past_min)
        if req.guide is not None and req.guide.is_done:
            # The document is complete: only EOS could follow (ignore_eos or not).
            stop = token_id if token_id in params.stop_token_ids else None
            return self.scheduler.finish(req, FinishReason.STOP, stop)
        if past_min:
            if not params.ignore_eos and token_id in req.eos_token_ids:
                return self.scheduler.finish(req, FinishReason.STOP)
            if token_id in params.stop_token_ids:
                return self.scheduler.finish(req, FinishReason.STOP, token_id)
            if detok is not None and detok.stop_hit is not None:
                return self.scheduler.finish(req, FinishReason.STOP, detok.stop_hit)
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            self.scheduler.finish(req, FinishReason.LENGTH)

    def _output(
        self, req: Request, new_ids: list[int], logprobs: list[TokenLogprobs] | None
    ) -> RequestOutput:
        finished = req.is_finished
        detok = (
            self._detok.pop(req.request_id, None) if finished else self._detok.get(req.request_id)
        )
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=detok.delta(finished) if detok is not None else "",
            finished=finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            logprobs=logprobs,
            prefill_s=req.prefill_s,
            decode_s=req.decode_s,
        )

    # -- offline use ------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run prompts (text or token ids) to completion; results in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        reqs = []
        for prompt, p in zip(prompts, params, strict=True):
            if isinstance(prompt, str):
                reqs.append(self.add_request(prompt=prompt, params=p))
            else:
                reqs.append(self.add_request(prompt_token_ids=list(prompt), params=p))
        texts: dict[str, list[str]] = {r.request_id: [] for r in reqs}
        while self.has_unfinished_requests():
            for o in self.step():
                if o.request_id in texts:
                    texts[o.request_id].append(o.new_text)
        return [
            Completion(
                request_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                token_ids=list(r.output_token_ids),
                text="".join(texts[r.request_id]),
                finish_reason=r.finish_reason,
                num_cached_tokens=max(r.num_cached_tokens, 0),
                num_preemptions=r.num_preemptions,
            )
            for r in reqs
        ]
