"""``threads`` travels with the work: numba keeps its thread count per Python thread, so the
count a model was loaded with must hold on every thread that runs its kernels: the caller's
(``run``, ``generate``), the engine's scheduler thread (``serve``, ``model.engine()``) and a chat's
answer thread. Each kernel entry of the forward path records the count in effect when it runs."""
from __future__ import annotations

import threading

import numba
import pytest

import cpullm
from cpullm.run.batch import BatchDecoder
from cpullm.run.executor import Executor
from cpullm.testing import make_random_checkpoint
from tiny_configs import SMOLLM2_LIKE

pytestmark = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2,
                                reason="needs a numba pool of 2+ threads to tell 1 thread from the default")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama"), tmp_path_factory.mktemp("t") / "m", seed=4)
    return cpullm.load(d, quant="int8", threads=1, n_ctx=96, max_chunk=16)


@pytest.fixture
def seen(monkeypatch):
    """(thread name, numba threads) each time a kernel entry of the forward path runs."""
    log = []

    def spy(cls, name):
        real = getattr(cls, name)

        def wrapped(self, *a, **kw):
            log.append((threading.current_thread().name, numba.get_num_threads()))
            return real(self, *a, **kw)
        monkeypatch.setattr(cls, name, wrapped)
    for cls, name in ((Executor, "prefill"), (Executor, "decode"), (Executor, "decode_argmax"),
                      (BatchDecoder, "decode")):
        spy(cls, name)
    return log


def _in_fresh_thread(fn):
    """Run ``fn`` on a new thread (numba's count there starts at the pool size) and return its result."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), name="caller")
    t.start()
    t.join()
    return out["r"]


def test_generate_on_any_thread_uses_the_models_threads(model, seen):
    _in_fresh_thread(lambda: list(model.generate_ids([1, 2, 3], 4, ignore_eos=True)))
    assert seen and {n for _, n in seen} == {1}, seen


def test_engine_thread_uses_the_models_threads(model, seen):
    with model.engine(parallel=2) as engine:
        reqs = [engine.submit([1, 2, 3 + i], max_new_tokens=4) for i in range(2)]
        for r in reqs:
            r.result()
    ran = [(t, n) for t, n in seen if t == "cpullm-scheduler"]
    assert ran and {n for _, n in ran} == {1}, seen


def test_on_token_requests_end_their_iterator(model):
    got = []
    with model.engine(parallel=1) as engine:
        req = engine.submit([1, 2, 3], max_new_tokens=3, on_token=got.append)
        assert list(req) == [] and req.result() == got[:-1] and got[-1] is None


def test_chat_answer_thread_uses_the_models_threads(model, seen):
    from cpullm.cli.commands.chat import _Answer
    list(_Answer(model, [1, 2, 3], 4, {}))
    assert seen and {n for _, n in seen} == {1}, seen


def test_serve_uses_the_models_threads(model, seen):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from cpullm.serve.http import create_app
    with TestClient(create_app(model, model_id="m", parallel=2)) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 200, r.text
    ran = [(t, n) for t, n in seen if t == "cpullm-scheduler"]
    assert ran and {n for _, n in ran} == {1}, seen


def test_run_command_uses_its_threads_flag(model, seen, capsys):
    from cpullm.cli import main
    assert _in_fresh_thread(lambda: main(["run", str(model.model_dir), "-p", "hello", "-n", "3",
                                          "--threads", "1", "--ctx", "96"])) == 0
    assert seen and {n for _, n in seen} == {1}, seen


def test_load_and_engine_warm_up_run_their_kernels_on_a_thread_that_ends(tmp_path, seen):
    """libgomp keeps an OpenMP team for every thread that started a parallel region; two teams on
    2 cores stop its threads spinning between regions (0.81x decode on the scheduler's thread).
    So neither the load nor the engine's warm-up runs a kernel on the caller's thread."""
    d = make_random_checkpoint(dict(SMOLLM2_LIKE, model_type="llama"), tmp_path / "m", seed=5)
    m = cpullm.load(d, quant="int8", threads=1, n_ctx=96, max_chunk=16)
    with m.engine(parallel=2):
        pass
    assert seen and {t for t, _ in seen} == {"cpullm-load"}, seen
    assert not [t for t in threading.enumerate() if t.name == "cpullm-load"]


def test_on_passing_thread_returns_raises_and_ends():
    from cpullm_kernels.setup.numba_setup import on_passing_thread
    assert on_passing_thread(lambda a, b=0: threading.current_thread().name + str(a + b), 1, b=2) == "cpullm-load3"
    with pytest.raises(KeyError, match="boom"):
        on_passing_thread(lambda: {}["boom"])
    assert not [t for t in threading.enumerate() if t.name == "cpullm-load"]
