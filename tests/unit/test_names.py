"""The named actors' names are a contract with running clusters and the docs: pin them."""

from clawray import names


def test_the_names_of_an_apps_actors():
    assert names.NAMESPACE == "clawray"
    assert [names.control_name("a"), names.judge_channel("a"), names.gate_name("a"),
            names.buffer_name("a"), names.voter_name("a", 1), names.hub_name("a", 2),
            names.env_buffer_name("a", "env-buffer"), names.curriculum_name("a"),
            names.env_adapter_name("a"), names.rm_buffer_name("a"),
            names.response_store_name("a")] == [
        "a:control", "a/judge", "a:gate", "a:buffer", "a:voter:1", "a:hub:2", "a:env-buffer",
        "a:curriculum", "a:env-adapter", "a:rm-buffer", "a-responses"]
    assert names.control_name(names.judge_channel("a")) == "a/judge:control"
