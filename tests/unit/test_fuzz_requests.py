"""bench/fuzz.py builds every request it sends, for any seed, with no service running: its generator is code too."""
import random

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from bench import fuzz
from vllm_v0.gateway.v1 import gateway_pb2
from vllm_v0.tokenizer.v1 import tokenizer_pb2
from vllm_v0.worker.v1 import worker_pb2

SEEDS = range(150)  # each field is left unset half the time: enough seeds for every one to be set
NAMES = [call.name for call in fuzz.CALLS]
SERVICES = {"gateway": gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"],
            "tokenizer": tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"],
            "worker": worker_pb2.DESCRIPTOR.services_by_name["ModelWorkerService"]}
Field = descriptor_pb2.FieldDescriptorProto


def as_list(request) -> list:
    return request if isinstance(request, list) else [request]


def set_fields(message, prefix: str = "") -> set[str]:
    """Dotted names of the fields set in `message` and the messages inside it."""
    found = set()
    for field, value in message.ListFields():
        name = prefix + field.name
        found.add(name)
        if field.message_type is None or field.message_type.GetOptions().map_entry:
            continue
        for inner in (value if field.is_repeated else [value]):
            found |= set_fields(inner, name + ".")
    return found


def every_field(descriptor, depth: int = 0, prefix: str = "") -> set[str]:
    """Dotted names of every field fuzz.fill can reach (it fills messages two levels down)."""
    found = set()
    for field in descriptor.fields:
        found.add(prefix + field.name)
        if field.message_type is not None and not field.message_type.GetOptions().map_entry and depth < 2:
            found |= every_field(field.message_type, depth + 1, prefix + field.name + ".")
    return found


@pytest.mark.parametrize("name", NAMES)
def test_every_call_builds_and_serializes_its_requests(name):
    """The class of mistake that kept `--start` from sending anything: a field kind that fill() mishandles."""
    for seed in SEEDS:
        for message in as_list(fuzz.make_request(name, seed)):
            message.SerializeToString()


@pytest.mark.parametrize("name", NAMES)
def test_every_field_of_every_request_is_fuzzed(name):
    messages = [m for seed in SEEDS for m in as_list(fuzz.make_request(name, seed))]
    seen = set().union(*(set_fields(m) for m in messages))
    assert every_field(messages[0].DESCRIPTOR) - seen == set()


def test_a_seed_gives_the_same_request_every_time():
    def wire(name, seed):
        return [m.SerializeToString(deterministic=True) for m in as_list(fuzz.make_request(name, seed))]

    for name in NAMES:
        assert wire(name, 7) == wire(name, 7)
    assert wire("gateway.Generate", 1) != wire("gateway.Generate", 2)
    with pytest.raises(KeyError, match="no fuzzed method"):
        fuzz.make_request("gateway.Nothing", 0)


def test_every_method_of_the_three_services_is_fuzzed_or_left_out_on_purpose():
    methods = {f"{service}.{method.name}": method for service, descriptor in SERVICES.items()
               for method in descriptor.methods}
    assert sorted(NAMES + list(fuzz.LEFT_OUT)) == sorted(methods)
    for call in fuzz.CALLS:  # one_call drives each call by the shape its method has
        method = methods[call.name]
        shape = ("bidi", "lockstep") if method.client_streaming else (method.server_streaming,)
        assert call.streaming in shape, call.name
        assert as_list(fuzz.make_request(call.name, 0))[0].DESCRIPTOR is method.input_type, call.name


def every_kind_message():
    """A proto3 message class with a field of every kind fill() may meet: scalars, bytes, an enum, messages, maps."""
    file = descriptor_pb2.FileDescriptorProto(name="fuzz_kinds.proto", package="fuzz_kinds", syntax="proto3")
    color = file.enum_type.add(name="Color")
    color.value.add(name="COLOR_UNSPECIFIED", number=0)
    color.value.add(name="RED", number=1)
    file.message_type.add(name="Inner").field.add(name="text", number=1, type=Field.TYPE_STRING,
                                                  label=Field.LABEL_OPTIONAL)
    message = file.message_type.add(name="EveryKind")
    kinds = {"TYPE_ENUM": ".fuzz_kinds.Color", "TYPE_MESSAGE": ".fuzz_kinds.Inner"}
    kinds |= {name: None for name in Field.Type.keys() if name not in ("TYPE_GROUP", "TYPE_ENUM", "TYPE_MESSAGE")}
    number = 0
    for kind, type_name in sorted(kinds.items()):
        for label, prefix in ((Field.LABEL_OPTIONAL, "one_"), (Field.LABEL_REPEATED, "many_")):
            number += 1
            field = message.field.add(name=prefix + kind.lower(), number=number, type=Field.Type.Value(kind),
                                      label=label)
            if type_name:
                field.type_name = type_name
    for entry_name, key, value, value_type in (("ByNameEntry", Field.TYPE_STRING, Field.TYPE_MESSAGE,
                                                ".fuzz_kinds.Inner"),
                                               ("BiasEntry", Field.TYPE_UINT32, Field.TYPE_FLOAT, None)):
        entry = message.nested_type.add(name=entry_name)
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=key, label=Field.LABEL_OPTIONAL)
        value_field = entry.field.add(name="value", number=2, type=value, label=Field.LABEL_OPTIONAL)
        if value_type:
            value_field.type_name = value_type
        number += 1
        message.field.add(name=entry_name.removesuffix("Entry").lower(), number=number, type=Field.TYPE_MESSAGE,
                          label=Field.LABEL_REPEATED, type_name=f".fuzz_kinds.EveryKind.{entry_name}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("fuzz_kinds.EveryKind"))


def test_fill_sets_a_field_of_every_kind():
    """So a field kind the protos take up later (bytes, an enum, another map) does not break the fuzz either."""
    cls = every_kind_message()
    assert {"one_type_bytes", "many_type_enum", "one_type_sfixed64", "byname", "bias"} <= \
        set(cls.DESCRIPTOR.fields_by_name)
    seen = set()
    for seed in SEEDS:
        message = fuzz.fill(cls(), random.Random(seed))
        assert set_fields(cls.FromString(message.SerializeToString())) == set_fields(message)
        seen |= set_fields(message)
    assert every_field(cls.DESCRIPTOR) - seen == set()
