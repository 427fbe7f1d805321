"""Adapters loaded at run time are a privilege: off unless serve.py --allow_runtime_lora (403), read
only under --adapter_root (no '..', no absolute path or symlink leading out), errors that name no server
path, host memory capped by --max_cpu_adapters (LRU; an evicted adapter is read again when requested),
and a `model` that is not a string is a 400. Fake adapters (a file of text per directory) and an
in-process app over a tiny GPT whose engine never starts: no weights are read, nothing decodes."""

import os

import jax
import pytest
from starlette.testclient import TestClient

from flaxgpt.data.tokenizers import CharTokenizer
from flaxgpt.models.gpt import GPTConfig, init_params
from flaxgpt.serve.adapters import AdapterPool, PathRefused

CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz "))


def fake_read(reads):
    def read(path):  # a real adapter's read names the path in its errors too
        reads.append(path)
        with open(os.path.join(path, "weights.txt")) as f:  # OSError naming the full path if absent
            return f.read()

    return read


@pytest.fixture
def root(tmp_path):
    """tmp/root/{a,b,c,nested/d} adapters, tmp/secret outside the root, root/escape -> ../secret."""
    r = tmp_path / "root"
    for name in ("a", "b", "c", "nested/d", "empty"):
        (r / name).mkdir(parents=True)
        if name != "empty":
            (r / name / "weights.txt").write_text(f"w:{name}")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "weights.txt").write_text("w:secret")
    (r / "escape").symlink_to(tmp_path / "secret")
    (r / "inside").symlink_to(r / "a")  # a symlink that stays inside is fine
    return r


def pool_under(root, reads=None, **kw):
    return AdapterPool(
        fake_read([] if reads is None else reads), lambda s, w: None, slots=2, runtime_root=root, **kw
    )


def test_runtime_paths_stay_under_the_root(root, tmp_path):
    pool = pool_under(root)
    assert pool.load_under_root("a", "a").weights == "w:a"
    assert pool.load_under_root("d", str(root / "nested" / "d")).weights == "w:nested/d"  # absolute inside
    assert pool.load_under_root("i", "inside").weights == "w:a"
    refused = {
        "x1": "../secret",
        "x2": "nested/../../secret",
        "x3": "a/../b",  # back inside, still refused: '..' is never needed
        "x4": str(tmp_path / "secret"),  # absolute, outside
        "x5": "escape",  # a symlink leading out
        "x6": "/etc",
    }
    for name, path in refused.items():
        with pytest.raises(PathRefused, match="'..'|outside the adapter root") as e:
            pool.load_under_root(name, path)
        assert str(tmp_path) not in str(e.value) or path.startswith(str(tmp_path)), e.value
    with pytest.raises(PathRefused, match="not found under the adapter root") as e:
        pool.load_under_root("m", "missing")
    assert str(root) not in str(e.value)
    with pytest.raises(ValueError, match="weights.txt") as e:  # read's own error, the root path replaced
        pool.load_under_root("e", "empty")
    assert str(root) not in str(e.value) and "'empty/weights.txt'" in str(e.value), e.value
    assert pool.names() == ["a", "d", "i"]  # nothing registered for a refused or failed load
    with pytest.raises(PermissionError):
        pool_under(None).load_under_root("a", "a")


def test_host_memory_is_capped_least_recently_used_first_and_evicted_adapters_reload(root):
    reads = []
    pool = pool_under(root, reads, max_host=2)  # one device slot
    a, b = pool.load_under_root("a", "a"), pool.load_under_root("b", "b")
    assert pool.acquire(a) == 1  # a is on the device: never evicted from host memory
    pool.release(1)
    pool.get("b")
    pool.load_under_root("c", "c")  # over 2: b is the least recent not on the device
    assert pool.host_names() == ["a", "c"] and pool.evictions == 1
    assert pool.names() == ["a", "b", "c"]  # b is still served
    assert pool.get("b") is None  # get never reads files
    again = pool.reload("b")
    assert again is not b and again.weights == "w:b" and again.key != b.key  # a new read, a new salt
    assert pool.host_names() == ["a", "b"] and reads[-1] == str(root / "b")  # c (not a) made room
    assert pool.acquire(b) == 1  # a request holding the evicted Adapter still runs with its weights
    assert pool.reload("nope") is None
    pool.unload("c")  # evicted: unloading only forgets the name
    assert pool.reload("c") is None and pool.names() == ["a", "b"]
    with pytest.raises(ValueError, match="below the 1 adapter slots"):
        pool_under(root, max_host=0)


@pytest.fixture(scope="module")
def tiny_sched():
    """A scheduler over a tiny GPT, its engine thread never started (nothing decodes)."""
    from flaxgpt.serve.launch import scheduler_for

    cfg = GPTConfig(vocab_size=len(CHARS), block_size=32, n_layer=1, n_head=2, n_embd=16)
    return cfg, scheduler_for(cfg, init_params(cfg, jax.random.key(0)), CharTokenizer(CHARS), slots=2)


def client(tiny_sched, pool):
    from flaxgpt.serve.server import create_app

    cfg, sched = tiny_sched
    sched.adapters = pool  # create_app reads it once
    app = create_app(sched, CharTokenizer(CHARS), model="tiny", max_len=32, vocab_size=cfg.vocab_size)
    return TestClient(app)


def test_http_runtime_loads_need_the_flag_and_stay_under_the_root(tiny_sched, root, tmp_path):
    for pool in (None, AdapterPool(fake_read([]), lambda s, w: None, slots=2)):  # no root: off
        with client(tiny_sched, pool) as c:
            for route in ("load_lora_adapter", "unload_lora_adapter"):
                r = c.post(f"/v1/{route}", json={"lora_name": "a", "lora_path": "a"})
                assert r.status_code == 403 and "--allow_runtime_lora" in r.json()["error"]["message"]
    with client(tiny_sched, pool_under(root)) as c:
        load = lambda name, path: c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})  # noqa: E731
        assert load("a", "a").status_code == 200
        for path in ("../secret", "escape", str(tmp_path / "secret"), "missing", "empty"):
            r = load("x", path)
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
            assert str(root) not in message and str(tmp_path / "secret") not in message.replace(path, ""), (
                message
            )
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "a"]
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200


def test_http_model_must_be_a_string_and_evicted_adapters_reload(tiny_sched, root):
    reads = []
    pool = pool_under(root, reads, max_host=1)
    with client(tiny_sched, pool) as c:
        for model in (None, 3, ["a"], {"name": "a"}):
            r = c.post("/v1/completions", json={"model": model, "prompt": "ab", "max_tokens": 2})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "model" and "must be a string" in err["message"]
        pool.load_under_root("a", "a"), pool.load_under_root("b", "b")
        assert pool.host_names() == ["b"]
        # the lookup comes before the body's checks: a bad max_tokens (400) shows a was read again
        r = c.post("/v1/completions", json={"model": "a", "prompt": "ab", "max_tokens": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] != "model", r.text
        assert pool.host_names() == ["a"] and reads.count(str(root / "a")) == 2
        r = c.post("/v1/completions", json={"model": "zz", "prompt": "ab"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        (root / "b" / "weights.txt").unlink()  # b can no longer be read again: 503, no path
        r = c.post("/v1/completions", json={"model": "b", "prompt": "ab"})
        assert r.status_code == 503 and str(root) not in r.text, r.text


def test_serve_flags(capsys):
    import serve

    base = ["--init_from", "gpt2", "--random_init"]
    for bad, needle in [
        (["--allow_runtime_lora"], "go together"),
        (["--adapter_root", "."], "go together"),
        (["--allow_runtime_lora", "--adapter_root", "/no/such/dir"], "not a directory"),
        (["--adapter", "a=x", "--max_adapters", "4", "--max_cpu_adapters", "2"], "below --max_adapters 4"),
    ]:
        with pytest.raises(SystemExit):
            serve.parse_args(base + bad)
        assert needle in capsys.readouterr().err, bad
    a = serve.parse_args(base + ["--allow_runtime_lora", "--adapter_root", "."])
    assert a.max_adapters == 4 and a.adapter_root == "." and a.max_cpu_adapters is None
    assert serve.parse_args(base).max_adapters == 0 and not serve.parse_args(base).allow_runtime_lora
