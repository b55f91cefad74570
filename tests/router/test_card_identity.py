"""Card checksum and identity: fixed vectors, path-only equality, separations."""

from __future__ import annotations

import struct
from dataclasses import fields

import blake3
import pytest

from kvstore.router.identity import (
    Domain,
    IdentityAlgorithm,
    cache_semantics_id,
    domain_of,
    routing_scope_id,
    semantics_material,
)
from kvstore.wire.card import NON_INPUTS, WorkerCard, card_checksum, validate_card
from kvstore.wire.errors import KVError
from kvstore.wire.framing import frame
from tests.router.conftest import BASE, card

R1, R2 = IdentityAlgorithm.R1, IdentityAlgorithm.R2

# -- fixed vectors: any change to the encoding or the input list breaks these --

BASE_CHECKSUM = "ddb09670527dbca286618c56230441da64c8c4d707a40d3b42c913e657a1be7e"
MINIMAL_CHECKSUM = "983397c1c9c11e74cee91193fd1efc5dd7032a095f2ead408e1af686fc7d4147"
R2_SEMANTICS = "e191facb96054f45fa2fcba206bd100b"  # llama-8b, 16, kvstore-blake3-v1
R1_SEMANTICS = "aab6384c92c5b66b1e36f945c44f7f78"  # BASE checksum, 16, kvstore-blake3-v1
EXPLICIT_SEMANTICS = "93216d40121cfd7a972a685779f86c44"  # override "shared-sem"
DEFAULT_SCOPE = "1744cf0a673ffcc9693ef277df4a55a4"  # default/backend/generate
EXPLICIT_SCOPE = "2cfc41292aac7255651d85f79f1216ab"  # override "pool-a"


def test_card_checksum_vectors():
    assert card_checksum(BASE) == BASE_CHECKSUM
    assert card_checksum(card(display_name="m", extra_files={}, source_path="")) == MINIMAL_CHECKSUM


def test_identity_vectors():
    assert (
        cache_semantics_id(
            semantics_material(R2, "llama-8b", BASE_CHECKSUM), 16, "kvstore-blake3-v1"
        ).hex()
        == R2_SEMANTICS
    )
    assert (
        cache_semantics_id(
            semantics_material(R1, "llama-8b", BASE_CHECKSUM), 16, "kvstore-blake3-v1"
        ).hex()
        == R1_SEMANTICS
    )
    assert (
        cache_semantics_id(
            semantics_material(R2, "x", "", "shared-sem"), 16, "kvstore-blake3-v1"
        ).hex()
        == EXPLICIT_SEMANTICS
    )
    assert routing_scope_id("default", "backend", "generate").hex() == DEFAULT_SCOPE
    assert routing_scope_id("default", "backend", "generate", "pool-a").hex() == EXPLICIT_SCOPE


def test_r2_semantics_by_hand():
    """The documented byte format, spelled out without the framing helper."""

    def s(text: str) -> bytes:
        data = text.encode()
        return b"s" + struct.pack("<Q", len(data)) + data

    def lst(*items: bytes) -> bytes:
        body = b"".join(items)
        return b"l" + struct.pack("<Q", len(body)) + body

    material = lst(s("kvstore/model-name/v1"), s("llama-8b"))
    data = lst(material, b"i" + struct.pack("<Qq", 8, 16), s("kvstore-blake3-v1"))
    assert blake3.blake3(data).digest()[:16].hex() == R2_SEMANTICS


def test_framing_is_injective_on_the_usual_traps():
    assert frame(["ab", "c"]) != frame(["a", "bc"])
    assert frame("") != frame(None)
    assert frame(1) != frame("1") != frame(True)
    assert frame([[]]) != frame([])


# -- what is and is not a checksum input --


def test_source_path_and_per_worker_facts_are_not_inputs():
    other = card(
        source_path="/mnt/elsewhere/llama",
        address="10.0.0.9:8000",
        capacity_blocks=77,
        node_id="node-z",
        final_namespace="t.0123456789abcdef",
        kv_events_endpoint="tcp://10.0.0.9:5557",
        component="other",
        endpoint="other",
        namespace="ns2",
        extra_files={"/mnt/elsewhere/llama/preprocessor_config.json": "pp-1"},
    )
    assert card_checksum(other) == BASE_CHECKSUM


def test_extra_files_are_sorted_by_basename():
    a = card(extra_files={"/a/x.json": "1", "/a/y.json": "2"})
    b = card(extra_files={"/b/c/y.json": "2", "x.json": "1"})
    assert card_checksum(a) == card_checksum(b)
    assert card_checksum(a) != card_checksum(card(extra_files={"/a/x.json": "2", "/a/y.json": "1"}))


@pytest.mark.parametrize(
    "change",
    [
        {"display_name": "other"},
        {"aliases": ["alias"]},
        {"model_config_checksum": "cfg-2"},
        {"tokenizer_checksum": "tok-2"},
        {"prompt_formatter_checksum": "fmt-2"},
        {"chat_template_checksum": "tpl-2"},
        {"generation_config_checksum": "gen-2"},
        {"extra_files": {"/models/llama-8b/preprocessor_config.json": "pp-2"}},
        {"extra_files": {}},
        {"prompt_context": "You are helpful."},
        {"context_length": 131072},
        {"kv_block_size": 32},
        {"worker_type": "prefill"},
        {"needs": ["tokenizer"]},
        {"router_config": "temperature=0.5"},
        {"indexer_semantics_override": "s"},
        {"indexer_scope_override": "p"},
        {"lora": True, "lora_base": "llama-8b"},
        {"multimodal": ["qwen-video"]},
    ],
)
def test_every_input_changes_the_checksum(change):
    assert card_checksum(card(**change)) != BASE_CHECKSUM


@pytest.mark.parametrize("name", [f.name for f in fields(WorkerCard)])
def test_each_field_is_an_input_or_explicitly_not(name):
    """A new card field must be sorted into one side: changing it either
    changes the checksum (input) or is listed in NON_INPUTS."""
    value = getattr(BASE, name)
    if isinstance(value, bool):
        changed = not value
    elif isinstance(value, int):
        changed = value + 1
    elif isinstance(value, str):
        changed = value + "-changed"
    elif isinstance(value, list):
        changed = [*value, "zz"]
    else:
        changed = {**value, "zz.json": "1"}
    same = card_checksum(card(**{name: changed})) == BASE_CHECKSUM
    assert same == (name in NON_INPUTS), name


@pytest.mark.parametrize(
    "change, field",
    [
        ({"display_name": ""}, "card.display_name"),
        ({"kv_block_size": 0}, "card.kv_block_size"),
        ({"namespace": "a.b"}, "card.namespace"),
        ({"aliases": ["x", "x"]}, "card.aliases"),
        ({"aliases": ["llama-8b"]}, "card.aliases"),
        ({"lora": True}, "card.lora_base"),
        ({"hash_format": "bad format"}, "card.hash_format"),
        ({"final_namespace": "tenant"}, "card.final_namespace"),
        # another client namespace's store blocks would show in this card's routes
        ({"namespace": "b-ns", "final_namespace": "a-ns.0123456789abcdef"}, "card.final_namespace"),
        ({"extra_files": {"/a/x": "1", "/b/x": "2"}}, "card.extra_files"),
        ({"aliases": [f"a{i}" for i in range(65)]}, "card.aliases"),
    ],
)
def test_validation_names_the_field(change, field):
    with pytest.raises(KVError) as err:
        validate_card(card(**change))
    assert err.value.code.name == "INVALID_ARGUMENT"
    assert field in err.value.message


# -- domains --


def dom(c: WorkerCard, algorithm=R2) -> Domain:
    return domain_of(c, card_checksum(c), algorithm)


@pytest.mark.parametrize("algorithm", [R1, R2])
def test_path_only_difference_gives_equal_domains(algorithm):
    a = card(source_path="/models/llama-8b")
    b = card(
        source_path="/mnt/nfs/llama-8b",
        extra_files={"/mnt/nfs/llama-8b/preprocessor_config.json": "pp-1"},
    )
    assert dom(a, algorithm) == dom(b, algorithm)


@pytest.mark.parametrize("algorithm", [R1, R2])
@pytest.mark.parametrize("change", [{"kv_block_size": 32}, {"hash_format": "vllm-sha256"}])
def test_block_size_and_hash_format_separate_semantics(algorithm, change):
    assert dom(BASE, algorithm).semantics_id != dom(card(**change), algorithm).semantics_id


@pytest.mark.parametrize(
    "change",
    [
        {"namespace": "ns2"},
        {"component": "prefill"},
        {"endpoint": "other"},
        {"indexer_scope_override": "pool-a"},
    ],
)
def test_scope_separates_domains(change):
    a, b = dom(BASE), dom(card(**change))
    assert a.semantics_id == b.semantics_id and a.scope_id != b.scope_id


def test_r2_keeps_roles_aliases_and_config_edits_in_one_domain_r1_splits_them():
    edits = [
        {"worker_type": "prefill"},
        {"aliases": ["llama"]},
        {"router_config": "t=1"},
        {"context_length": 8192},
        {"generation_config_checksum": "gen-9"},
    ]
    for edit in edits:
        assert dom(card(**edit), R2) == dom(BASE, R2), edit
        assert dom(card(**edit), R1) != dom(BASE, R1), edit
    assert dom(card(display_name="other"), R2) != dom(BASE, R2)


def test_explicit_overrides():
    a = card(indexer_semantics_override="shared-sem")
    b = card(display_name="renamed", indexer_semantics_override="shared-sem")
    # The semantics override replaces the material only: names no longer matter ...
    assert dom(a).semantics_id == dom(b).semantics_id
    assert dom(a).semantics_id.hex() == EXPLICIT_SEMANTICS
    assert dom(a, R1).semantics_id == dom(a, R2).semantics_id
    # ... but block size still does, and the scope is untouched.
    assert (
        dom(card(indexer_semantics_override="shared-sem", kv_block_size=32)).semantics_id
        != dom(a).semantics_id
    )
    assert dom(a).scope_id == dom(BASE).scope_id
    # The scope override replaces namespace/component/endpoint, not the semantics.
    c = card(indexer_scope_override="pool-a", namespace="ns9", component="x", endpoint="y")
    d = card(indexer_scope_override="pool-a")
    assert dom(c).scope_id == dom(d).scope_id and dom(c).scope_id.hex() == EXPLICIT_SCOPE
    assert dom(c).semantics_id == dom(BASE).semantics_id
