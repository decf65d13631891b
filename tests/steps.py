"""Tests' shorthand for one sequence run step by step on a model's forward path: a fresh slot of
:class:`cpullm.run.forward.Forward`, with reset / prefill / decode (full logits) / decode_argmax."""
import numba

from cpullm.run.executor import Executor
from cpullm.run.forward import Forward


class Steps:
    def __init__(self, src):
        """``src``: a loaded model, a Forward, or an Executor (run with the calling thread's count)."""
        if isinstance(src, Executor):
            src = Forward(src, numba.get_num_threads())
        self.fwd = getattr(src, "forward", src)
        self.slot = self.fwd.new_slot()

    def __getattr__(self, name):
        """The executor's attributes (``program``, ``I``, ``screen``, ...) for tests that read them."""
        return getattr(self.fwd.executor, name)

    @property
    def position(self) -> int:
        return self.slot.position

    def reset(self):
        self.fwd.reset(self.slot)

    def prefill(self, ids, all_logits=False):
        return self.fwd.prefill(self.slot, ids, all_logits)

    def decode(self, tok):
        """One step's full logits (vocab,)."""
        return self.fwd.step([self.slot], [int(tok)])[0][0]

    def decode_argmax(self, tok) -> int:
        """One greedy step: only the next token (a lone row may read the lm_head screen)."""
        return self.fwd.step([self.slot], [int(tok)], greedy=[True])[1][0]
