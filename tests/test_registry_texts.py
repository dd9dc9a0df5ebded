"""What users read about the registries is drawn from them, or checked against them: --help's lists, the losses'
sections of docs/losses.md and the rules' table of docs/protocol.md. A new dataset, loss or rule shows up in these
by itself, or fails here."""

import re

from cli_support import REPO, run_cli

from spml_cache import datasets, losses, observation


def test_help_lists_every_dataset_and_every_rule(tmp_path):
    extract = run_cli("extract", "--help", cwd=tmp_path).stdout
    linear = run_cli("linear", "--help", cwd=tmp_path).stdout
    for name in datasets.names():  # openimages included (the hand-written list had left it out)
        assert re.search(rf"\b{re.escape(name)}\b", extract), name
    for rule in observation.RULES.values():
        assert rule.example in extract and rule.example in linear, rule.example


def test_import_features_help_lists_the_datasets_whose_readers_give_a_published_id_prefix(tmp_path):
    text = " ".join(run_cli("import-features", "--help", cwd=tmp_path).stdout.split())
    known = [name for name in datasets.names() if datasets.reader(name).PUBLISHED_ID_PREFIX is not None]
    assert ", ".join(known[:-1]) + f" or {known[-1]}" in text


def test_docs_losses_has_a_section_for_every_built_in_loss_and_no_other():
    text = (REPO / "docs" / "losses.md").read_text(encoding="utf-8")
    sections = re.findall(r"^### `([a-z0-9_]+)`", text, flags=re.MULTILINE)
    assert sorted(sections) == sorted(losses.names())
    table = text[text.index("| loss | term where `z = -1` |"):]
    table = table[: table.index("\n\n")]
    in_table = {name for row in table.splitlines()[2:] for name in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])}
    assert in_table == set(losses.names())


def test_docs_protocol_names_every_observation_rule():
    text = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
    rules = text[text.index("## Observation rules"):]
    named = set(re.findall(r"^\| `([a-z-]+)[:`]", rules, flags=re.MULTILINE))
    assert set(observation.RULES) <= named, set(observation.RULES) - named
