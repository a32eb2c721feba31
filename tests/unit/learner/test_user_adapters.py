"""Per-user adapters (clawray/learner/adapters.py) on one LoRA learner: a user's rows train only
that user's adapter (every other user's stored state stays byte-identical), each user's policy
is what their own updates made it, a new user starts at the base policy, deletion forgets."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pytest
import torch

from clawray.config import TrainingConfig
from clawray.learner.adapters import AdapterStore, UserAdapters, user_slug
from clawray.learner.learner import LearnerCore, init_distributed
from tests.support.common import free_port
from tests.support.learner_data import sampled_rows


def of_user(table: pa.Table, user: str) -> pa.Table:
    """The rows as ``user``'s (their policy user)."""
    return table.set_column(table.schema.get_field_index("policy_user"), "policy_user",
                            pa.array([user] * table.num_rows, pa.string()))


@pytest.fixture(scope="module")
def rows(tiny_model_path) -> pa.Table:
    return sampled_rows(tiny_model_path, 8, seed=5, max_new=10)


@pytest.fixture(scope="module")
def make_bank(tiny_model_path):
    init_distributed(0, 1, "127.0.0.1", free_port())

    def make(root, **kw) -> UserAdapters:
        cfg = TrainingConfig(**{"lr": 1e-2, "lora_rank": 4, "lora_alpha": 8, "zero_stage": 0,
                                **kw})
        return UserAdapters(LearnerCore(tiny_model_path, cfg), AdapterStore(root))

    return make


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_users_rows_train_only_that_users_adapter(make_bank, rows, tmp_path):
    bank = make_bank(tmp_path / "adapters")
    base = bank.logprobs("new-user", rows)
    bank.update("alice", of_user(rows, "alice"))
    bank.update("bob", of_user(rows.slice(0, 4), "bob"))
    bob_file = bank.store.path("bob")
    bob_bytes, bob_lp = digest(bob_file), bank.logprobs("bob", rows)

    for _ in range(2):  # alice trains on: bob's stored adapter is not touched
        out = bank.update("alice", of_user(rows, "alice"))
    assert out["version"] == 3 and bank.version("bob") == 1
    assert digest(bob_file) == bob_bytes
    # bob's policy is still exactly what his one update made it, after alice used the slot
    assert bank.logprobs("bob", rows) == bob_lp
    alice_lp = bank.logprobs("alice", rows)
    moved = max(abs(a - b) for x, y in zip(alice_lp, bob_lp) for a, b in zip(x, y))
    assert moved > 1e-3
    # a user who never trained is served the base policy (a fresh adapter is B = 0)
    assert bank.logprobs("carol", rows) == base
    assert not bank.store.exists("carol")

    metas = {m["user"]: m for m in bank.store.users()}
    assert set(metas) == {"alice", "bob"}
    assert metas["alice"]["rows_trained"] == 3 * rows.num_rows and metas["bob"]["rows_trained"] == 4
    # folder names are fingerprints, not the user ids
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == \
        sorted([user_slug("alice"), user_slug("bob")])


def test_a_users_training_resumes_from_their_own_optimizer_state(make_bank, rows, tmp_path):
    """Two updates of one user with another user's update in between give the same adapter
    as the two updates back to back: weights and AdamW moments travel with the user."""
    a = make_bank(tmp_path / "a")
    a.update("alice", of_user(rows, "alice"))
    a.update("bob", of_user(rows.slice(0, 4), "bob"))
    a.update("alice", of_user(rows, "alice"))
    b = make_bank(tmp_path / "b")
    b.update("alice", of_user(rows, "alice"))
    b.update("alice", of_user(rows, "alice"))
    wa, wb = a.store.load("alice")["weights"], b.store.load("alice")["weights"]
    assert set(wa) == set(wb) and len(wa) > 0
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst < 1e-6
    # and the second update did use the first one's moments (a fresh optimizer differs)
    c = make_bank(tmp_path / "c")
    c.update("alice", of_user(rows, "alice"))
    c.optimizer.state.clear()
    c.update("alice", of_user(rows, "alice"))
    wc = c.store.load("alice")["weights"]
    assert max(float((wc[k] - wb[k]).abs().max()) for k in wc) > 1e-4


def test_rows_of_another_user_are_refused_and_delete_forgets(make_bank, rows, tmp_path):
    bank = make_bank(tmp_path / "adapters")
    mixed = pa.concat_tables([of_user(rows.slice(0, 2), "alice"), of_user(rows.slice(2, 2), "bob")])
    with pytest.raises(ValueError, match="rows of other users"):
        bank.update("alice", mixed)
    assert not bank.store.exists("alice")  # nothing trained, nothing written
    bank.update("alice", of_user(rows, "alice"))
    base = make_bank(tmp_path / "other").logprobs("x", rows)
    assert bank.delete("alice") and not bank.store.exists("alice")
    assert bank.store.users() == [] and bank.version("alice") == 0
    assert bank.logprobs("alice", rows) == base  # back to a fresh adapter
    assert bank.delete("alice") is False


def test_per_user_adapters_need_lora_at_stage_zero(make_bank, tmp_path):
    with pytest.raises(ValueError, match="need LoRA"):
        make_bank(tmp_path / "a", lora_rank=0)
    with pytest.raises(ValueError, match="ZeRO stage 0"):
        make_bank(tmp_path / "b", zero_stage=1)
    with pytest.raises(ValueError, match="user id"):
        AdapterStore(tmp_path / "c").path("")


def test_the_payload_is_the_users_adapter(make_bank, rows, tmp_path):
    bank = make_bank(tmp_path / "adapters")
    bank.update("alice", of_user(rows, "alice"))
    from clawray.models.lora import modules

    pa_, pf = modules(bank.payload("alice")), modules(bank.payload("fresh"))
    assert pa_.keys() == pf.keys()
    assert all(torch.count_nonzero(b) == 0 for _, b, _ in pf.values())  # peft's init: B = 0
    assert any(torch.count_nonzero(b) > 0 for _, b, _ in pa_.values())


def test_an_exported_adapter_loads_in_peft_as_the_users_policy(make_bank, rows, tmp_path,
                                                              tiny_model_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from clawray.learner.adapters import export_peft
    from clawray.learner.learner import packed_logprobs
    from clawray.learner.batch import make_batch
    from clawray.config import LossSettings

    bank = make_bank(tmp_path / "adapters")
    bank.update("alice", of_user(rows, "alice"))
    want = bank.logprobs("alice", rows)
    folder = export_peft(bank.store, "alice", tmp_path / "alice-peft")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        lp = packed_logprobs(model, make_batch(rows, LossSettings()))[0].numpy()
    got = [float(x) for x in lp]
    flat = [x for r in want for x in r]
    assert len(got) == len(flat) and max(abs(a - b) for a, b in zip(got, flat)) < 1e-4
    with pytest.raises(KeyError, match="no adapter"):
        export_peft(bank.store, "nobody", tmp_path / "x")


def test_clawray_users_lists_exports_and_deletes(make_bank, rows, tmp_path, capsys):
    from clawray.apps.cli import main

    folder = tmp_path / "adapters"
    bank = make_bank(folder)
    bank.update("key-a/ann", of_user(rows, "key-a/ann"))
    assert main(["users", "list", "--dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "key-a/ann\tversion 1\trows 8" in out and "1 in" in out
    assert main(["users", "export", "key-a/ann", "--dir", str(folder),
                 "--out", str(tmp_path / "peft")]) == 0
    assert (tmp_path / "peft" / "adapter_model.safetensors").exists()
    # a sample log holding ann's and bob's rows: delete forgets ann's rows with her adapter
    from clawray.buffer.core import SampleBufferCore, fetch

    log = tmp_path / "samples"
    core = SampleBufferCore(log)
    core.add([dict(r, sample_id=f"s-{i}", policy_user=u) for i, (r, u) in enumerate(
        zip(rows.to_pylist(), ["key-a/ann", "key-a/bob"] * len(rows)))])
    core.seal()
    del core
    capsys.readouterr()
    delete = ["users", "delete", "key-a/ann", "--dir", str(folder), "--samples", str(log)]
    assert main(delete) == 0
    assert "adapter and optimizer state deleted; 4 rows forgotten" in capsys.readouterr().out
    assert bank.store.users() == []
    again = SampleBufferCore(log)
    assert fetch(again.take(4)).column("policy_user").to_pylist() == ["key-a/bob"] * 4
    assert again.take(1) == []
    assert main(delete) == 2  # nothing of hers is left: said so, not a silent success
    assert "has no adapter" in capsys.readouterr().err


def test_restart_lora_sets_a_kept_version_and_forgets_its_moments(make_bank, rows, tmp_path):
    """The policy gate's trainer restarts from the incumbent after an abandoned candidate."""
    from clawray.learner.adapters import _torch_optimizer, restart_lora
    from clawray.models.lora import PREFIX, from_peft_model

    core = make_bank(tmp_path / "gate").core
    base_lp = core.logprobs(rows)
    core.update(rows)
    kept, kept_lp = from_peft_model(core.module), core.logprobs(rows)
    core.update(rows)  # the line goes on (the candidate that will be abandoned)
    assert core.logprobs(rows) != kept_lp
    assert restart_lora(core, kept) > 0
    for got, want in zip(core.logprobs(rows), kept_lp):
        assert got == pytest.approx(want, abs=1e-6)
    optimizer = _torch_optimizer(core)
    lora_params = [p for n, p in core.module.named_parameters() if "lora_" in n]
    assert lora_params and all(p not in optimizer.state for p in lora_params)
    restart_lora(core, None)  # back to the base model
    for got, want in zip(core.logprobs(rows), base_lp):
        assert got == pytest.approx(want, abs=1e-6)
    # a well-formed adapter of another rank at one module does not fit this learner's
    key = next(k for k in kept["state"] if k.endswith("lora_A.weight"))
    a, b = kept["state"][key], kept["state"][key.replace("lora_A", "lora_B")]
    module = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
    wrong = {**kept, "config": {**kept["config"], "rank_pattern": {module: a.shape[0] + 1}},
             "state": {**kept["state"], key: torch.zeros(a.shape[0] + 1, a.shape[1]),
                       key.replace("lora_A", "lora_B"): torch.zeros(b.shape[0], a.shape[0] + 1)}}
    with pytest.raises(ValueError, match="does not fit this learner's adapter"):
        restart_lora(core, wrong)
