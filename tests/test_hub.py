"""Models by Hugging Face Hub id (blockspec/hub): a cache laid out as huggingface_hub lays it out
resolves offline for --model, --draft and LLM(...); `blockspec download` against a local server
that answers the Hub's endpoints (tests/fake_hub.py) fetches only the engine's files, resumes,
verifies and refuses a disk that is too small; misses are one-line errors."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import namedtuple
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
from fake_hub import FakeHub

from blockspec import LLM, ConfigError, EngineConfig, SamplingParams
from blockspec.cli import build_parser, main
from blockspec.hub import is_hub_id, resolve_model_path, served_name
from blockspec.summary import summarize

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ENGINE_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja"}
# Files a repo holds that an engine never reads.
EXTRA = {"README.md": b"# tiny\n", ".gitattributes": b"*.safetensors filter=lfs\n",
         "original/consolidated.safetensors": b"not read", "modeling_tiny.py": b"x = 1\n"}


@pytest.fixture(autouse=True)
def hf_env(tmp_path, monkeypatch):
    """Each test: its own HF cache, online, no token, and a Hub that refuses connections
    (port 9 on localhost) unless the test starts a fake one."""
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return tmp_path


@pytest.fixture
def hub(monkeypatch, qwen3_path, drafter16):
    fake = FakeHub()
    fake.add_repo("org/tiny", qwen3_path, extra=EXTRA)
    fake.add_repo("org/tiny-dflash", drafter16)
    server = fake.start()
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    yield fake
    server.shutdown()
    server.server_close()


def lay_out_cache(cache: Path, repo_id: str, folder: Path, commit: str = "a" * 40) -> Path:
    """models--org--name/{blobs, snapshots/COMMIT/<links to blobs>, refs/main}, as
    huggingface_hub writes it."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        blob = storage / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(blob)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def one_error_line(capsys) -> str:
    """The error: one line, the last on stderr (after any download progress)."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("blockspec: error:")]
    assert len(errors) == 1 and err[-1] == errors[0], err
    return errors[0]


# -- names ----------------------------------------------------------------------------------------
def test_hub_id_shape():
    for name in ("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", "a/b", "org_1/m.v2"):
        assert is_hub_id(name), name
    for name in ("/abs/path", "./rel", "gpt2", "a/b/c", "a--b/c", "a/b..c", "-a/b", "a/b.",
                 "a/b.git", "org/", "~/models/x"):
        assert not is_hub_id(name), name


def test_local_path_wins_and_neither_is_one_line(tmp_path, monkeypatch, qwen3_path):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(qwen3_path, tmp_path / "org" / "tiny")
    # NOTE: the Hub (port 9) refuses connections: a lookup would fail
    assert resolve_model_path("org/tiny") == "org/tiny"
    assert EngineConfig(model="org/tiny", device="cpu").model_path == "org/tiny"
    assert served_name("org/tiny") == "tiny" and served_name("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    for bad in ("/no/such/folder", "a/b/c", "nope"):
        with pytest.raises(ConfigError, match="not a directory, nor a Hugging Face Hub id"):
            EngineConfig(model=bad, device="cpu")
    with pytest.raises(ConfigError, match="is a local folder"):
        EngineConfig(model="org/tiny", device="cpu", revision="v1")


# -- a cache laid out by hand, offline ------------------------------------------------------------
def test_cached_hub_ids_resolve_offline(hf_env, monkeypatch, qwen3_path, drafter16, capsys):
    cache = Path(hf_constants.HF_HUB_CACHE)
    target = lay_out_cache(cache, "org/tiny", qwen3_path)
    drafter = lay_out_cache(cache, "org/tiny-dflash", drafter16, commit="b" * 40)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)

    cfg = EngineConfig(model="org/tiny", draft="org/tiny-dflash", device="cpu")
    assert (cfg.model_path, cfg.draft_path, cfg.tokenizer_path) == \
        (str(target), str(drafter), str(target))
    assert cfg.model == "org/tiny"  # NOTE: the name stays what the user gave
    assert EngineConfig(model="org/tiny", device="cpu", revision="a" * 40).model_path == \
        str(target)

    kw = dict(device="cpu", num_kv_blocks=64, speculation_policy="fixed", cost_profile="none")
    by_id = LLM("org/tiny", draft="org/tiny-dflash", **kw).generate("def f(x):", GREEDY)[0]
    by_path = LLM(str(qwen3_path), draft=str(drafter16), **kw).generate("def f(x):", GREEDY)[0]
    assert by_id.token_ids == by_path.token_ids and by_id.metrics.spec is not None

    assert main(["generate", "--model", "org/tiny", "--draft", "org/tiny-dflash", "--device",
                 "cpu", "--num-kv-blocks", "64", "--prompt", "def f(x):", "--max-tokens", "4",
                 "--cost-profile", "none"]) == 0
    assert capsys.readouterr().out.strip()


def test_offline_and_unreachable_misses_are_one_line(hf_env, monkeypatch, qwen3_path, capsys):
    # Online, but the Hub refuses connections and nothing is cached.
    with pytest.raises(ConfigError, match="cannot be reached") as e:
        EngineConfig(model="org/missing", device="cpu")
    assert "\n" not in str(e.value) and "blockspec download org/missing" in str(e.value)
    # Offline and not cached: --model, --draft and LLM(...) alike.
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert main(["generate", "--model", "org/missing", "--prompt", "x", "--device", "cpu"]) == 2
    line = one_error_line(capsys)
    assert "HF_HUB_OFFLINE is set" in line and "'org/missing'" in line
    assert main(["generate", "--model", str(qwen3_path), "--draft", "org/nodraft", "--prompt",
                 "x", "--device", "cpu"]) == 2
    assert "draft 'org/nodraft'" in one_error_line(capsys)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE"):
        LLM("org/missing", device="cpu")


def test_unreachable_hub_falls_back_to_the_cache(hf_env, qwen3_path):
    target = lay_out_cache(Path(hf_constants.HF_HUB_CACHE), "org/tiny", qwen3_path)
    assert resolve_model_path("org/tiny") == str(target)  # online, Hub down


# -- serve MODEL ----------------------------------------------------------------------------------
def test_serve_takes_the_model_positionally(capsys):
    parse = build_parser().parse_args
    assert parse(["serve", "org/tiny", "--port", "1"]).model_tag == "org/tiny"
    assert parse(["serve", "--model", "org/tiny"]).model_tag is None
    assert main(["serve", "org/a", "--model", "org/b"]) == 2
    assert "two models given" in one_error_line(capsys)


# -- blockspec download ---------------------------------------------------------------------------
def test_download_fetches_verifies_and_summarizes(hub, monkeypatch, capsys, qwen3_path):
    assert main(["download", "org/tiny", "--draft", "org/tiny-dflash"]) == 0
    out = capsys.readouterr().out
    storage = Path(hf_constants.HF_HUB_CACHE) / "models--org--tiny"
    snapshot = storage / "snapshots" / hub.repos["org/tiny"].commit
    assert f"model org/tiny @ {hub.repos['org/tiny'].commit[:12]}: {snapshot}" in out
    assert "sha256 of 1 LFS file(s), git blob sha1 of 5" in out
    assert "Qwen3ForCausalLM (qwen3)" in out and "DFlash drafter, block 16" in out
    assert "serve it with: blockspec serve org/tiny --draft org/tiny-dflash" in out
    assert "plan per GPU  TP 1 x EP 1" in out and "verdict     fits" in out  # inspect
    # Only the engine's files, byte for byte (no README, subfolder, or untrusted *.py).
    assert {p.name for p in snapshot.iterdir()} == ENGINE_FILES
    assert set(hub.file_gets()) == ENGINE_FILES | {"config.json", "model.safetensors"}
    for name in ENGINE_FILES:
        assert (snapshot / name).read_bytes() == (qwen3_path / name).read_bytes()
    assert (storage / "refs" / "main").read_text() == hub.repos["org/tiny"].commit
    # The params count is the HF model's own.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_path))
    assert summarize(snapshot)["params"] == sum(p.numel() for p in hf.parameters())
    # Downloaded once, it serves offline by id.
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    llm = LLM("org/tiny", device="cpu", num_kv_blocks=32)
    assert llm.engine.config.model_path == str(snapshot)


def test_an_incomplete_cache_is_one_line_offline(hub, monkeypatch, capsys):
    assert main(["download", "org/tiny"]) == 0
    snapshot = Path(resolve_model_path("org/tiny"))
    (snapshot / "tokenizer.json").unlink()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"lacks 1 file\(s\) \(tokenizer.json\), and "
                                          "HF_HUB_OFFLINE is set"):
        EngineConfig(model="org/tiny", device="cpu")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    assert main(["download", "org/tiny"]) == 0  # online, the missing file comes back
    assert (snapshot / "tokenizer.json").is_file()


def test_download_resumes_a_dropped_transfer(hub, monkeypatch, qwen3_path):
    # NOTE: huggingface_hub resumes from the last whole chunk it wrote: small chunks here.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 256)
    hub.drop_once["model.safetensors"] = 1000
    assert main(["download", "org/tiny"]) == 0
    assert hub.gets("model.safetensors") == [None, "bytes=768-"]
    snapshot = Path(hf_constants.HF_HUB_CACHE) / "models--org--tiny" / "snapshots" / \
        hub.repos["org/tiny"].commit
    assert (snapshot / "model.safetensors").read_bytes() == \
        (qwen3_path / "model.safetensors").read_bytes()


def test_an_interrupted_download_resumes_where_it_stopped(hub, capsys):
    hub.fail_get.add("model.safetensors")
    assert main(["download", "org/tiny"]) == 2
    line = one_error_line(capsys)
    assert "run the same command again to resume" in line
    hub.fail_get.clear()
    hub.requests.clear()
    assert main(["download", "org/tiny"]) == 0
    assert hub.file_gets() == ["model.safetensors"]  # the rest was kept


def test_download_refuses_a_disk_too_small(hub, monkeypatch, capsys, qwen3_path):
    from blockspec.hub.files import format_bytes

    usage = namedtuple("usage", "total used free")
    free = {"bytes": 5000}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, free["bytes"]))
    assert main(["download", "org/tiny"]) == 2
    line = one_error_line(capsys)
    need = sum((qwen3_path / name).stat().st_size for name in ENGINE_FILES)
    assert f"not enough disk space for model 'org/tiny': {format_bytes(need)} to download" in line
    assert "5.0 KB free" in line and hub.file_gets() == []  # checked before any download
    free["bytes"] = 10**12
    assert main(["download", "org/tiny"]) == 0
    # What is on disk already does not count: with the files cached, nothing is needed.
    free["bytes"] = 5000
    assert main(["download", "org/tiny"]) == 0


def test_download_verification_catches_corruption(hub, capsys):
    assert main(["download", "org/tiny"]) == 0
    blobs = Path(hf_constants.HF_HUB_CACHE) / "models--org--tiny" / "blobs"
    repo = hub.repos["org/tiny"]
    for name, hashname in (("model.safetensors", "sha256"), ("config.json", "git sha1")):
        blob = blobs / repo.etag(name)
        good = blob.read_bytes()
        blob.write_bytes(bytes([good[0] ^ 1]) + good[1:])  # same size, one bit off
        capsys.readouterr()
        assert main(["download", "org/tiny"]) == 2
        line = one_error_line(capsys)
        assert f"{name}: {hashname}" in line and "fails verification" in line
        blob.write_bytes(good)


def test_download_errors_are_one_line(hub, capsys):
    hub.add_repo("org/gated", Path(hf_constants.HF_HUB_CACHE).parent, gated=True)
    for argv, words in ((["org/nope"], "the Hugging Face Hub has no model 'org/nope'"),
                        (["org/tiny", "--revision", "v9"], "has no revision 'v9'"),
                        (["org/gated"], "is gated"),
                        (["./local"], "is not a Hugging Face Hub id"),
                        (["org/tiny", "--draft-revision", "x"], "need --draft")):
        assert main(["download", *argv]) == 2
        assert words in one_error_line(capsys), argv


def test_download_local_dir_revision_and_remote_code(hub, tmp_path, capsys):
    commit = hub.repos["org/tiny"].commit
    out_dir = tmp_path / "models" / "tiny"
    assert main(["download", "org/tiny", "--revision", commit, "--local-dir", str(out_dir),
                 "--trust-remote-code"]) == 0
    out = capsys.readouterr().out
    assert f": {out_dir}" in out and f"serve it with: blockspec serve {out_dir}" in out
    assert {p.name for p in out_dir.iterdir() if p.is_file()} == ENGINE_FILES | {"modeling_tiny.py"}
    assert not (out_dir / "original").exists()


def test_a_sharded_repo_fetches_the_index_shards_only(hub, qwen3_path):
    weights = (qwen3_path / "model.safetensors").read_bytes()
    index = {"metadata": {}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}
    hub.add_repo("org/sharded", qwen3_path, extra={
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00001.safetensors": weights})
    del hub.repos["org/sharded"].files["model.safetensors"]
    hub.repos["org/sharded"].files["consolidated.safetensors"] = weights
    path = Path(resolve_model_path("org/sharded"))
    assert {"model.safetensors.index.json", "model-00001-of-00001.safetensors"} <= \
        {p.name for p in path.iterdir()}
    assert not (path / "consolidated.safetensors").exists()


def test_dummy_weights_fetch_no_weights(hub):
    cfg = EngineConfig(model="org/tiny", device="cpu", load_format="dummy")
    assert not (Path(cfg.model_path) / "model.safetensors").exists()
    assert (Path(cfg.model_path) / "config.json").is_file()
