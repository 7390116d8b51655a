"""The rlhost Python package against this build's librlhost and plugins (ctest embed_python_pytest).

Environment: RLHOST_LIB (librlhost.so of the build), RLHOST_PLUGIN_PATH (its plugins),
RLH_SOURCE_DIR (the repository), RLH_TINY_MODEL (the rlh_tiny_model tool)."""
import os
import subprocess
import threading

import pytest

import rlhost

SRC = os.environ["RLH_SOURCE_DIR"]
DEMO = os.path.join(SRC, "examples", "configs", "grpo_demo_cpu.yaml")
PLUGINS = ["dtensor", "generator", "grpo", "environments", "tokenizer_hf", "model_llama", "kernels_cpu"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run([os.environ["RLH_TINY_MODEL"], str(out), "--alphabet", "0123456789+-*=", "--seed", "1"],
                   check=True, capture_output=True)
    return str(out)


def grpo_host(tiny_model, out_dir, steps=3):
    h = rlhost.Host(log_level="error")
    h.load_plugins(PLUGINS)
    h.load_config(DEMO)
    h.set("policy.model_name", tiny_model)
    h.set("checkpointing.checkpoint_dir", str(out_dir / "ckpt"))
    h.set("logger.log_dir", str(out_dir / "logs"))
    h.override(f"grpo.max_num_steps={steps}", "grpo.num_prompts_per_step=8",
               "grpo.num_generations_per_prompt=4", "grpo.val_period=2", "grpo.max_val_samples=16",
               "grpo.val_batch_size=16")
    return h


def test_abi_version_and_plugins():
    assert rlhost.abi_version() >= (0, 2)
    with rlhost.Host() as h:
        h.load_plugin("grpo")
        listed = {p.get("name"): p for p in h.plugins()}
        assert listed["grpo"]["loaded"] is True
        assert any(c["kind"] == "algorithm" and c["name"] == "grpo" for c in listed["grpo"]["components"])


def test_config_from_dict_and_yaml_text():
    with rlhost.Host() as h:
        h.load_config({"grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2},
                       "policy": {"train_global_batch_size": "${mul:${grpo.num_prompts_per_step},2}"}})
        assert "train_global_batch_size: 8" in h.resolved_config()
        h.load_config("grpo:\n  num_prompts_per_step: 3\n")
        h.set("grpo.max_num_steps", 7)
        text = h.resolved_config()
        assert "num_prompts_per_step: 3" in text and "max_num_steps: 7" in text


def test_errors_carry_message_and_code():
    with rlhost.Host() as h:
        with pytest.raises(rlhost.Error) as e:
            h.load_plugin("no_such_plugin")
        assert e.value.code == rlhost.NOT_FOUND and e.value.code_name == "NOT_FOUND"
        assert "no_such_plugin" in e.value.message and "\n" not in e.value.message
        with pytest.raises(rlhost.Error) as e:
            h.load_config("/no/such/config.yaml")
        assert e.value.code == rlhost.INVALID_ARGUMENT and "/no/such/config.yaml" in str(e.value)
        h.load_config({"policy": {"train_global_batch_sise": 4}})
        with pytest.raises(rlhost.Error) as e:
            h.resolved_config()
        assert "did you mean 'policy.train_global_batch_size'" in e.value.message
        # A NeMo-RL setting rlhost lacks: refused at the start check, named with its value.
        h.load_config({"logger": {"mlflow_enabled": True}})
        with pytest.raises(rlhost.Error) as e:
            h.check_config()
        assert e.value.code == rlhost.UNIMPLEMENTED
        assert "config key 'logger.mlflow_enabled' = true" in e.value.message
        # The cluster's size is checked against the launcher's world (here one process).
        h.load_config({"cluster": {"num_nodes": 4}})
        with pytest.raises(rlhost.Error) as e:
            h.check_config()
        assert e.value.code == rlhost.INVALID_ARGUMENT
        assert "cluster.num_nodes = 4" in e.value.message and "no launcher (one rank)" in e.value.message
        h.load_config({"cluster": {"num_nodes": 1}, "logger": {"wandb_enabled": False}})
        report = h.check_config()
        assert "logger.wandb_enabled=false" in report["accepted"] and report["refused"] == []


def test_grpo_job_with_metrics_callback(tiny_model, tmp_path):
    seen = []
    with grpo_host(tiny_model, tmp_path) as h:
        h.run(on_metric=lambda name, value, step: seen.append((name, value, step)))
        recorded = h.metrics()
    losses = [(s, v) for n, v, s in seen if n == "train/loss"]
    assert [s for s, _ in losses] == [1, 2, 3]
    # The callback saw what the host recorded, in order.
    assert [(m["name"], m["value"], m["step"]) for m in recorded] == seen
    assert any(n == "validation/accuracy" for n, _, _ in seen)
    assert os.path.isdir(tmp_path / "ckpt")


def test_stop_from_the_callback_and_from_another_thread(tiny_model, tmp_path):
    with grpo_host(tiny_model, tmp_path / "a", steps=50) as h:
        def stop_at_two(name, value, step):
            if name == "train/loss" and step >= 2:
                h.cancel()
        with pytest.raises(rlhost.Error) as e:
            h.run(on_metric=stop_at_two)
        assert e.value.code == rlhost.CANCELLED
        assert max(m["step"] for m in h.metrics() if m["name"] == "train/loss") < 50
    with grpo_host(tiny_model, tmp_path / "b", steps=100000) as h:
        started = threading.Event()
        timer = threading.Thread(target=lambda: (started.wait(60), h.cancel()))
        timer.start()
        with pytest.raises(rlhost.Error) as e:
            h.run(on_metric=lambda *a: started.set())
        timer.join()
        assert e.value.code == rlhost.CANCELLED


def test_an_exception_in_the_callback_stops_the_job_and_is_raised(tiny_model, tmp_path):
    class Stop(Exception):
        pass

    def boom(name, value, step):
        if name == "train/loss":
            raise Stop(step)
    with grpo_host(tiny_model, tmp_path, steps=50) as h:
        with pytest.raises(Stop):
            h.run(on_metric=boom)
