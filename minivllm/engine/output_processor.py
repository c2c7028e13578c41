"""From model output to ``RequestOutput`` (vLLM: ``vllm/v1/engine/output_processor.py``
with its detokenizer and logprobs processor).

After the scheduler has appended a step's tokens and finished requests
(``Scheduler.update_from_output``), this records what the outputs carry: sampled and
prompt log-probs as ``{token_id: Logprob}`` dicts, the precision monitor's per-token
statistics, and, for each finished (or streamed) request, the detokenized text in a
:class:`~minivllm.outputs.RequestOutput`.
"""

from __future__ import annotations

from minivllm.core.scheduler import SchedulerUpdate
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.request import Request, RequestStatus


class OutputProcessor:
    """Args:
        tokenizer: the model's tokenizer, or None (outputs then carry no text).

    Attributes:
        precision_monitor: a :class:`minivllm.precision.monitor.DriftMonitor` fed every
            finished request's sampled-token statistics, or None
            (``LLMEngine.set_precision_monitor``).
    """

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.precision_monitor = None

    def process_outputs(self, requests: dict[str, Request], result,
                        update: SchedulerUpdate) -> list[RequestOutput]:
        """Record one step's log-probs and build the outputs of the requests it finished.

        Args:
            requests: the step's scheduled requests by id.
            result: the step's ``ModelRunnerOutput``.
            update: what ``Scheduler.update_from_output`` did with it.
        Returns:
            a ``RequestOutput`` per request in ``update.finished``, in that order.
        """
        for rid, chunk in result.prompt_logprobs.items():
            self.append_prompt_logprobs(requests[rid], chunk)
        so = result.sampler_output
        # the precision monitor's per-row statistics, moved to the host once per step
        monitored = None if so is None or so.raw_sampled_logprobs is None else (
            so.raw_sampled_logprobs.tolist(), so.raw_entropy.tolist())
        for i, req in update.sampled:
            if req.logprobs is not None:
                self.append_logprobs(req, so, i, result.sampled_token_ids[i])
            if monitored is not None:
                if req.monitor_stats is None:
                    req.monitor_stats = ([], [])
                req.monitor_stats[0].append(monitored[0][i])
                req.monitor_stats[1].append(monitored[1][i])
        return [self.make_output(req) for req in update.finished]

    def detokenize(self, req: Request) -> str:
        """The request's output text so far ("" without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(req.output_token_ids,
                                     skip_special_tokens=req.sampling_params.skip_special_tokens)

    def logprob_entry(self, token: int, logprob: float, rank: int, n: int,
                      topk_ids, topk_logprobs) -> dict[int, Logprob]:
        """token id -> Logprob for the actual/sampled token plus the top ``n``
        (``topk_*``: 1-D tensors of length >= n, or None when n == 0)."""
        ids, lps, ranks = [token], [logprob], [rank]
        if n:
            ids += topk_ids[:n].tolist()
            lps += topk_logprobs[:n].tolist()
            ranks += list(range(1, n + 1))
        d: dict[int, Logprob] = {}
        for t, lp, r in zip(ids, lps, ranks):
            if t not in d:
                d[t] = Logprob(lp, r, None if self.tokenizer is None
                               else self.tokenizer.decode([t]))
        return d

    def append_logprobs(self, req: Request, so, i: int, token: int) -> None:
        """Row ``i`` of the sampler output ``so`` (the request's sampled ``token``)."""
        n = req.sampling_params.logprobs
        assert n is not None and req.logprobs is not None  # called only when asked for
        lp = float(so.sampled_logprobs[i])
        req.logprobs.append(self.logprob_entry(
            token, lp, int(so.sampled_ranks[i]), n,
            so.topk_ids[i] if n else None, so.topk_logprobs[i] if n else None))
        req.cumulative_logprob += lp

    def append_prompt_logprobs(self, req: Request, chunk) -> None:
        """A ``PromptLogprobsChunk``; positions already recorded before a preemption (the
        prompt was recomputed) are skipped."""
        n = req.sampling_params.prompt_logprobs
        assert n is not None and req.prompt_logprobs is not None  # called only when asked for
        for j, tok in enumerate(chunk.token_ids):
            if chunk.first_pos + j < len(req.prompt_logprobs):
                continue  # already recorded before a preemption (the prompt was recomputed)
            req.prompt_logprobs.append(self.logprob_entry(
                tok, float(chunk.token_logprobs[j]), int(chunk.ranks[j]), n,
                chunk.topk_ids[j] if n else None, chunk.topk_logprobs[j] if n else None))

    def make_output(self, req: Request) -> RequestOutput:
        """The request's ``RequestOutput`` now (finished or not). Detokenizes the output
        (without the EOS / stop token, as vLLM v1; a stop string already cut the text)
        and, once a request has finished, feeds its statistics to the precision monitor."""
        if (self.precision_monitor is not None and req.status.finished
                and req.monitor_stats is not None):
            self.precision_monitor.update(*req.monitor_stats)
            req.monitor_stats = None  # counted once
        p = req.sampling_params
        if req.stop_reason is None or not isinstance(req.stop_reason, str):
            ids = req.output_token_ids
            if req.status == RequestStatus.FINISHED_STOPPED and not p.include_stop_str_in_output:
                ids = ids[:-1]  # as vLLM v1: the EOS / stop token id is not in the text
            req.output_text = "" if self.tokenizer is None else self.tokenizer.decode(
                ids, skip_special_tokens=p.skip_special_tokens)
        finish = req.status.value if req.status.finished else None
        comp = CompletionOutput(
            index=0, text=req.output_text, token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=req.logprobs, finish_reason=finish, stop_reason=req.stop_reason)
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finish_time": req.finish_time, "num_preemptions": req.num_preemptions,
                   "spec_decode": {"num_drafts": req.spec_num_drafts,
                                   "num_draft_tokens": req.spec_num_draft_tokens,
                                   "num_accepted_tokens": req.spec_num_accepted_tokens}}
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids,
                             prompt_logprobs=req.prompt_logprobs, outputs=[comp],
                             finished=req.status.finished, num_cached_tokens=req.num_cached_tokens,
                             metrics=metrics)
