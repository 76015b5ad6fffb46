"""The synchronous engine core: add requests, step, collect per-step outputs. Not thread-safe;
AsyncEngine drives it from one thread.

Over ~400 lines on purpose: LLMEngine is one object whose construction steps and step loop
share its state; the work itself lives in the modules it calls (scheduler, sampler,
speculation, model_runner, tp/)."""
from __future__ import annotations

import logging
import os
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, wait as wait_futures

import numpy as np
import torch

from backend.engine.buckets import BucketPlan
from backend.engine.coldpath import ColdPathCounter
from backend.engine.config import EngineConfig
from backend.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from backend.engine.sampling.guided import GuidedMasker, GuidedState
from backend.engine.kv_manager import KVCacheManager
from backend.engine.sampling.logprobs import decode_tokens
from backend.engine.lora import LoraRegistry
from backend.engine.model_files import load_tokenizer, resolve_model_dir
from backend.engine.model_runner import ModelRunner
from backend.engine.outputs import RequestOutput, output_for
from backend.engine.parallel_sampling import (SampleGroup, child_seed, fork_rows,
                                              merged_output, take_rows)
from backend.engine.pooling import PoolingConfig
from backend.engine.request_check import PreparedRequest, prepare_embedding, prepare_request
from backend.engine.sampling.sampler import Sampler, make_generator
from backend.engine.sampling.sampling_params import SamplingParams
from backend.engine.scheduler import Scheduler
from backend.engine.speculation.speculator import (CPU_STEP_COST, CPU_VERIFY_ROWS, GPU_STEP_COST,
                                         NgramSpeculator, StepCost)
from backend.engine.sequence import Sequence, Status
from backend.engine.speculation import step_cost
from backend.engine.step_inputs import StepInputs, build_step_inputs
from backend.engine.warmup import warm_up as run_warmup
from backend.engine.stats import EngineStats
from backend.engine.tp.launch import launch_group
from backend.model.config import ModelConfig
from backend.model.greedy_head import GreedyPicks
from backend.model.loader import load_model
from backend.parallel.context import ParallelContext
from tpllm_kernels import cpu_ext

log = logging.getLogger("backend.engine")
_NO_TEXT = DetokenizerUpdate("", False, None)


class LLMEngine:
    @staticmethod
    def device_is_cpu_without_bf16(device: torch.device, dtype: torch.dtype) -> bool:
        """bfloat16 asked for on a CPU whose kernels have no native bf16 arithmetic."""
        return (device.type == "cpu" and dtype == torch.bfloat16
                and cpu_ext.isa_level() != "avx512_bf16")

    def __init__(self, config: EngineConfig, defer_warmup: bool = False):
        """Loads the model. Unless `defer_warmup`, also warms up and is ready on return; with it,
        the caller runs warm_up() itself, on the thread that will step the engine."""
        config.validate()
        t0 = self._t_start = time.perf_counter()
        self.config = config
        threads = self._set_threads()
        self._read_model()
        num_blocks = self._size_kv_cache()
        self._choose_device()
        self._start_ranks(num_blocks, threads)
        self._build_policies(num_blocks)
        self.requests: dict[str, Sequence] = {}  # an n > 1 request: its sample 0
        self._block_copies: list[tuple[int, int]] = []  # (source, copy) for the next forward
        self._arrivals = 0
        self.stats = EngineStats()
        self.warm_shapes: set[tuple[str, int]] = set()
        self._log_loaded(time.perf_counter() - t0, num_blocks)
        if not defer_warmup:
            self.warm_up()

    def _set_threads(self) -> int | None:
        """This process's torch threads (None: torch's default)."""
        config, tp = self.config, self.config.tensor_parallel_size
        # Under TP the ranks share the cores: by default each gets its share, not all of them
        # (multi-host: the ranks on this host share them).
        here = config.tp_local_ranks or tp
        threads = config.num_threads or (max(1, (os.cpu_count() or 1) // here) if tp > 1 else None)
        if threads:
            torch.set_num_threads(threads)
        return threads

    def _read_model(self) -> None:
        """The checkpoint's directory, config, tokenizer and the longest sequence served."""
        self.model_dir = resolve_model_dir(self.config.model)
        self.model_config = cfg = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        # sliding windows are served (every attention kernel takes a layer's window): the
        # model's whole context
        limit = cfg.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        self.pooling = PoolingConfig.from_dir(self.model_dir, self.config.pooling)

    def _size_kv_cache(self) -> int:
        """KV blocks per rank: as configured, else what kv_cache_memory_gb holds."""
        config = self.config
        bytes_per_block = self.model_config.kv_bytes_per_token(
            config.torch_dtype.itemsize, config.tensor_parallel_size) * config.block_size
        return config.num_kv_blocks or max(
            1, int(config.kv_cache_memory_gb * 2**30) // bytes_per_block)

    def _choose_device(self) -> None:
        dtype = self.config.torch_dtype
        self.device = self.config.resolved_device()  # rank 0's; rank r uses the r-th next GPU
        if self.device_is_cpu_without_bf16(self.device, dtype):
            log.warning("dtype bfloat16 on a CPU without AVX512-BF16 (kernels: %s): its GEMMs "
                        "widen to float32 as they go, so prefill takes several times float32's "
                        "time and decode is no faster (docs/decisions.md). float32 is the better "
                        "choice here", cpu_ext.isa_level())
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # Triton and NCCL launch on the current device

    def _start_ranks(self, num_blocks: int, threads: int | None) -> None:
        """Rank 0's model and runner here, the other TP ranks started and ready; on failure
        whatever started is closed again."""
        config, cfg = self.config, self.model_config
        self.plan = BucketPlan.build(config.max_num_seqs, config.max_num_batched_tokens)
        self.cold_path = ColdPathCounter()
        self.group = None
        self.loras = LoraRegistry.from_config(config)
        ctx = ParallelContext()
        try:
            if config.tensor_parallel_size > 1:
                ctx = self._launch_group(cfg, num_blocks, threads)
            model = load_model(self.model_dir, cfg, ctx, config.torch_dtype, self.device)
            self.loras.attach(model, config.lora_modules, cfg, config.max_lora_rank)
            self.runner = ModelRunner(model, num_blocks, config.block_size, self.max_model_len,
                                      config.torch_dtype, self.device, self.packed_rows)
            if config.greedy_screening:  # every TP rank alike (WorkerSpec.greedy_screening)
                model.lm_head.enable_greedy_screening()
            if self.uses_cuda_graphs:  # captured per bucket by warmup, before ready
                self.runner.enable_decode_graphs(self.plan.decode_sizes, True, self._captured)
            if self.group is not None:
                self.group.wait_ready()
        except BaseException:
            self.close()
            raise

    def _build_policies(self, num_blocks: int) -> None:
        """The KV cache manager, scheduler, guided-decoding masker, sampler and speculator."""
        config, cfg = self.config, self.model_config
        # every layer windowed (Mistral): blocks behind the window are released
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 cfg.kv_window, config.max_num_batched_tokens)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.plan, config.resolved_step_overhead_tokens(self.device),
                                   config.max_loras if config.enable_lora else 0)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset(cfg.eos_token_ids) | ({tok_eos} if tok_eos is not None else set())
        # Structured output: grammars compile on their own thread from the tokenizer's vocabulary.
        self.guided = GuidedMasker(self.tokenizer, cfg.vocab_size, self.eos_token_ids) \
            if self.tokenizer is not None else None
        self._grammar_waits: list[Sequence] = []  # admitted, grammar not started yet
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed, mask=self.guided)
        # verify rows stay within the decode buckets and, on CPU, where a step is still bound by
        # reading the weights (a step's FMAs grow with its rows; at 8 concurrent requests with
        # 3 drafts each, 32-row verify steps made bench speculation's (c) 0.95x)
        on_cpu = self.device.type == "cpu"
        self.speculator = NgramSpeculator(
            config.speculative_ngram, config.speculative_ngram_match,
            min(self.plan.decode_sizes[-1], CPU_VERIFY_ROWS if on_cpu else 1 << 30),
            CPU_STEP_COST if on_cpu else GPU_STEP_COST
        ) if config.speculative_ngram else None

    def _log_loaded(self, seconds: float, num_blocks: int) -> None:
        config = self.config
        log.info("engine loaded in %.1fs: %s, %s on %s, TP %d, %d KV blocks x %d tokens (%.2f GiB "
                 "per rank), max_model_len %d, %d threads per rank, %.2f GiB of packed weights "
                 "for %d-row batches", seconds,
                 self.model_dir.name, config.dtype, self.device, config.tensor_parallel_size,
                 num_blocks, config.block_size, self.runner.kv_cache_bytes / 2**30,
                 self.max_model_len, torch.get_num_threads(),
                 self.runner.packed_weight_bytes / 2**30, self.packed_rows)

    def warm_up(self) -> None:
        """Run every bucket (if config.warmup), then mark the engine ready: from here on anything
        that compiles, captures or meets a new shape counts as a cold path. Call it on the thread
        that steps the engine: OpenMP thread teams and oneDNN scratchpads belong to the calling
        thread, so warming another thread would leave the serving thread's cold."""
        if self.config.warmup:
            try:
                self.stats.warmup_seconds = run_warmup(self)
                if self.speculator is not None and self.device.type == "cpu":
                    # this machine's verify-step costs (step_cost.py); a GPU keeps its guess
                    self.speculator.cost = StepCost(step_cost.measure_engine(self))
            except BaseException:
                self.close()
                raise
        self.cold_path.ready = True
        log.info("engine ready in %.1fs (warmup %.1fs, %d buckets, %d CUDA graphs)",
                 time.perf_counter() - self._t_start, self.stats.warmup_seconds,
                 len(self.warm_shapes), self.runner.num_graph_captures)

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.device.type == "cuda" and self.config.cuda_graphs

    @property
    def packed_rows(self) -> int:
        """The batch the CPU linears keep packed weights for: the largest decode bucket."""
        on = self.device.type == "cpu" and self.config.cpu_packed_gemm
        return self.plan.decode_sizes[-1] if on else 0

    def _captured(self, bucket: int) -> None:
        """A decode bucket's CUDA graph was captured: free before ready, a cold path after."""
        self.cold_path.record("cuda_graph_capture", f"decode bucket {bucket}")

    def _launch_group(self, cfg: ModelConfig, num_blocks: int,
                      threads: int | None) -> ParallelContext:
        self.group = launch_group(self.config, cfg, self.model_dir, num_blocks, threads,
                                  self.max_model_len, self.plan.decode_sizes, self.packed_rows,
                                  self.uses_cuda_graphs, self.device)
        weakref.finalize(self, self.group.close)
        if self.config.pin_cpus:
            os.sched_setaffinity(0, {0})
        return self.group.ctx

    @property
    def needs_recovery(self) -> bool:
        """A tensor-parallel worker died: the group must be rebuilt before the next step."""
        return self.group is not None and not self.group.closed and (
            self.group.step_failed or not self.group.workers_alive())

    def recover(self) -> None:
        """Rebuild the TP group after a worker died. Requests in flight must have been failed
        (abort_all) first; their blocks are free, the cache contents are never read again."""
        t0 = time.perf_counter()
        log.warning("rebuilding the tensor-parallel group")
        self.group.restart()
        self.kv.reset_prefix_cache()  # the new workers' caches are empty; warmup overwrites ours
        self.runner.reset_decode_graphs()  # captured with the old group's communicator
        if self.config.warmup:  # the new workers warm up too; not a cold path of serving
            self.cold_path.ready = False
            try:
                run_warmup(self)
            finally:
                self.cold_path.ready = True
        self.stats.recoveries += 1
        log.warning("tensor-parallel group rebuilt in %.1fs", time.perf_counter() - t0)

    def close(self) -> None:
        """Stop tensor-parallel workers (if any). The engine is unusable afterwards."""
        if self.group is not None:
            self.group.close()
        if getattr(self, "guided", None) is not None:
            self.guided.close()

    # ---- requests -------------------------------------------------------------------------
    def prepare_request(self, request_id: str, prompt: str | list[int],
                        params: SamplingParams | None = None) -> PreparedRequest:
        """Validate and tokenize; raises ValueError naming the field. Safe off the engine thread."""
        if not self.runner.model.generates:
            raise ValueError("text_input: this model only embeds (its checkpoint has no "
                             "lm_head); send an embedding request")
        if params is not None:
            self.loras.check(params)
        return prepare_request(request_id, prompt, params, self.tokenizer,
                               self.model_config.vocab_size, self.max_model_len, self.kv,
                               self.guided, self.config.max_num_seqs)

    def prepare_embedding(self, request_id: str, prompt: str | list[int],
                          dimensions: int | None = None) -> PreparedRequest:
        """An embedding request, validated and tokenized (ValueError naming the field); add it
        with add_request. Safe off the engine thread."""
        return prepare_embedding(request_id, prompt, dimensions, self.pooling,
                                 self.model_config.hidden_size, self.tokenizer,
                                 self.model_config.vocab_size, self.max_model_len, self.kv)

    def add_request(self, request_id: str, prompt: str | list[int] | PreparedRequest,
                    params: SamplingParams | None = None) -> None:
        req = prompt if isinstance(prompt, PreparedRequest) else \
            self.prepare_request(request_id, prompt, params)
        if req.request_id in self.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already in flight")
        p = req.params
        seq = Sequence(
            request_id=req.request_id, token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids), params=p, arrival=self._arrivals,
            generator=make_generator(p.seed),
            detokenizer=self._detokenizer(req.prompt_token_ids, p))
        if p.n > 1:
            seq.group = SampleGroup(seq.request_id, p.n, [seq])
        if req.embedding is not None:
            seq.embedding, seq.detokenizer = req.embedding, None
        self.loras.bind(seq)
        self._arrivals += 1
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        if req.guided is not None:
            seq.guided = req.guided
            self._grammar_waits.append(seq)

    def _detokenizer(self, prompt_ids: list[int], p: SamplingParams):
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, p.stop,
                                      p.include_stop_str_in_output, p.skip_special_tokens)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request (every sample of an n > 1 one); its final 'abort' output."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        for s in seq.group.live() if seq.group is not None else (seq,):
            self.scheduler.finish(s)
            s.finish_reason = s.finish_reason or "abort"
        seq.finish_reason = "abort"
        return output_for(seq, "", [])

    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[RequestOutput]:
        outs = []
        for rid in list(self.requests):
            out = self.abort_request(rid)
            out.finish_reason, out.error = reason, error
            outs.append(out)
        return outs

    @property
    def _screens_greedy(self) -> bool:
        """Whether argmax-only steps take the greedy screen (greedy_head.py): rank 0 has it and,
        under TP, so has every other rank (they said so when ready)."""
        return self.runner.model.lm_head.screen is not None and (
            self.group is None or self.group.screening_everywhere)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs = self._start_grammars() if self._grammar_waits else []
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, len(self.scheduler.waiting),
                                    self.config.max_num_seqs)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self._grammar_waits:  # only grammars to wait for: sleep until one is compiled
                wait_futures([s.guided.grammar for s in self._grammar_waits], timeout=0.05,
                             return_when=FIRST_COMPLETED)
            return outputs
        inputs, sampling, pooled = build_step_inputs(sched.scheduled, self.kv.block_size,
                                                     self.plan)
        if self._block_copies:  # forked in an earlier step: copied before this step writes
            inputs.block_copies = np.asarray(self._block_copies, dtype=np.int64)
            self._block_copies = []
        logits_rows = None
        if any(s.group is not None and not s.group.forked for s in sampling):
            sampling, logits_rows, copies = fork_rows(sampling, self._new_sample, self.kv,
                                                      self.scheduler)
            self._block_copies += copies
        rows = [r for seq in sampling for r in (
            self.speculator.verify_rows(seq) if seq.draft_token_ids else (seq,))]
        inputs.argmax_only = self._screens_greedy and self.sampler.argmax_only(rows)
        if inputs.shape_key not in self.warm_shapes:
            self.cold_path.record("new_shape", str(inputs.shape_key))
            self.warm_shapes.add(inputs.shape_key)
        comm0 = self._collective_seconds()
        logits, hidden = self.run_model(inputs), None
        if inputs.hidden_rows is not None:
            logits, hidden = logits
        if logits_rows is not None:  # forked samples draw from their prompt's logits row
            logits = take_rows(logits, logits_rows)
        t1 = time.perf_counter()
        comm_s = self._collective_seconds() - comm0
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n - len(seq.draft_token_ids)  # drafts: once accepted
            self.kv.computed(seq)  # their K/V are written now: others may share them
            seq.model_seconds += t1 - t0
            seq.collective_seconds += comm_s
        if pooled:
            outputs += self._pool(pooled, hidden)
        appended = 0
        if sampling:
            sampled = self.sampler(logits, rows)
            i = 0
            groups: dict[SampleGroup, dict[int, RequestOutput]] = {}
            failed: set[SampleGroup | None] = set()
            for seq in sampling:  # a verified sequence owns 1 + drafts consecutive rows
                n = 1 + len(seq.draft_token_ids)
                if seq.status is not Status.FINISHED:  # else a sample whose request failed
                    out = self._sampled_output(seq, sampled, i, n)
                    appended += len(out.token_ids)
                    if seq.group is None or out.finish_reason == "error":
                        outputs.append(out)  # an n > 1 request that failed: this ends it
                        failed.add(seq.group)
                    else:
                        groups.setdefault(seq.group, {})[seq.index] = out
                i += n
            outputs += [merged_output(g, parts) for g, parts in groups.items()
                        if g not in failed]
        t2 = time.perf_counter()
        self.stats.record_step(sched.num_tokens, appended, t1 - t0, t2 - t1,
                               len(sched.preempted), comm_s)
        self.stats.prefix_cache_queries += sched.prefix_queries
        self.stats.prefix_cache_hits += sched.prefix_hits
        return outputs

    def run_model(self, inputs: StepInputs) -> torch.Tensor | GreedyPicks | None:
        """One forward pass on every rank; logits (rank 0's) for inputs.logits_indices, or
        GreedyPicks for an argmax_only step (ModelRunner.forward)."""
        if self.group is None:
            return self.runner.forward(inputs)
        try:
            self.group.broadcast(inputs)
            return self.runner.forward(inputs)
        except Exception:
            # The other ranks are gone or stuck mid-step: rebuild before the next step. A dead
            # rank's channel may still look open here (a killed process's sockets close one by
            # one as it exits; the collective's can fail first).
            self.group.step_failed = True
            raise

    def _pool(self, pooled: list[tuple[Sequence, int, int]], hidden: torch.Tensor | None
              ) -> list[RequestOutput]:
        """Hand the embedding requests their hidden rows; finish those whose prompt is done."""
        outputs, row = [], 0
        for seq, first, k in pooled:
            if k:
                seq.embedding.add(first, hidden[row:row + k])
                row += k
            if seq.num_computed_tokens == seq.num_tokens:
                seq.finish_reason = "stop"
                seq.first_token_time = time.perf_counter()
                self._retire(seq)
                out = output_for(seq, "", [])
                out.embedding = seq.embedding.result()
                outputs.append(out)
        return outputs

    def _retire(self, seq: Sequence) -> None:
        """seq has finished: its blocks back; its request ends once every sample has."""
        self.scheduler.finish(seq)
        if seq.group is None or seq.group.done:
            del self.requests[seq.request_id]
            self.stats.finished_requests += 1

    def _new_sample(self, parent: Sequence, index: int) -> Sequence:
        """Sample `index` of parent's request: its prompt, its own generator, detokenizer and
        grammar matcher (started: the parent's grammar has compiled)."""
        p, prompt = parent.params, parent.token_ids[:parent.num_prompt_tokens]
        child = Sequence(
            request_id=parent.request_id, token_ids=list(prompt),
            num_prompt_tokens=parent.num_prompt_tokens, params=p, arrival=parent.arrival,
            generator=make_generator(child_seed(p.seed, index)),
            detokenizer=self._detokenizer(prompt, p), group=parent.group, index=index,
            lora_id=parent.lora_id, arrival_time=parent.arrival_time,
            num_cached_tokens=parent.num_cached_tokens)
        if parent.guided is not None:
            child.guided = GuidedState(parent.guided.spec, parent.guided.grammar)
            error = self.guided.start(child.guided)
            assert error is None, error  # the same grammar started for the parent
        return child

    def _start_grammars(self) -> list[RequestOutput]:
        """Start the matchers whose grammar compiled; fail, alone, the requests whose did not."""
        outputs, still = [], []
        for seq in self._grammar_waits:
            if seq.status is Status.FINISHED:  # aborted meanwhile
                continue
            if not seq.guided.grammar.done():
                still.append(seq)
            elif (error := self.guided.start(seq.guided)) is not None:
                outputs.append(self._fail(seq, error))
        self._grammar_waits = still
        return outputs

    def _fail(self, seq: Sequence, error: str, invalid: bool = True) -> RequestOutput:
        out = self.abort_request(seq.request_id)
        seq.finish_reason = out.finish_reason = "error"
        out.error, out.invalid = error, invalid
        return out

    def _collective_seconds(self) -> float:
        return self.group.comm.seconds if self.group is not None else 0.0

    def _append_token(self, seq: Sequence, token: int, logprob: float | None) -> RequestOutput:
        p = seq.params
        if seq.guided is not None and not self.guided.accept(seq.guided, token):
            # only if the constraint and min_tokens (EOS banned) leave no token at all
            return self._fail(seq, f"{seq.guided.spec.field}: the grammar allows no token here "
                                   f"(min_tokens {p.min_tokens} not reached?)", invalid=False)
        seq.token_ids.append(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        update = seq.detokenizer.add_tokens([token]) if seq.detokenizer else _NO_TEXT
        delta = update.delta
        if update.stopped:
            seq.finish_reason, seq.stop_reason = "stop", update.stop_reason
        elif not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.guided is not None and seq.guided.complete:  # nothing but EOS may follow
            seq.finish_reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if not update.stopped and seq.detokenizer:
                delta += seq.detokenizer.flush()
            self._retire(seq)
        return output_for(seq, delta, [token])

    def _sampled_output(self, seq: Sequence, sampled, row: int, n: int) -> RequestOutput:
        """Append what seq sampled in rows [row, row + n): its token, or (verifying n - 1
        drafts) the drafts the model agrees with plus the model's next token, as one update."""
        accepted = 0
        if n == 1 and seq.spec is not None:
            self.speculator.observe(seq, sampled.token_ids[row])
        if n > 1:
            accepted = self.speculator.accept(seq, sampled.token_ids[row:row + n])
            self.stats.spec_draft_tokens += n - 1
            self.stats.spec_accepted_tokens += accepted
            seq.draft_token_ids = []
        parts = []
        for r in range(row, row + accepted + 1):
            parts.append(self._append_token(seq, sampled.token_ids[r], sampled.logprobs[r]))
            self._attach_logprobs(parts[-1], sampled.position_logprobs[r],
                                  seq.params.skip_special_tokens)
            if seq.finish_reason is not None:
                return RequestOutput.merged(parts)
        if accepted:  # the accepted drafts' K/V (written this step) now count as computed
            seq.num_computed_tokens += accepted
            self.kv.computed(seq)
        return RequestOutput.merged(parts)

    def _attach_logprobs(self, out: RequestOutput, pos, skip_special_tokens: bool) -> None:
        """A token's logprobs (rows with params.top_logprobs) onto its output, with each token's
        text (the tokenizer lives here, not in the sampler) as the request's text shows it: a
        skipped special token's is "", as vLLM's."""
        if pos is not None:
            def decode(ids: list[int]) -> str:
                return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            out.logprobs = [decode_tokens(pos, decode) if self.tokenizer is not None else pos]
