"""A request's wire Sampling reaches the engine whole (services/worker/build.py): every field by its name, the
constraint as the engine's grammar."""

from __future__ import annotations

from services.worker.build import sampling_options
from services.worker.engine.request import GrammarSpec
from shared.wire.events import Constraint, Sampling


def test_every_sampling_field_reaches_the_engine_options():
    wire = Sampling(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        seed=-3,
        min_tokens=2,
        stop_token_ids=(4, 5),
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logprobs=3,
        constraint=Constraint("json_schema", "{}"),
        logit_bias=((10, 100.0),),
    )
    opts = sampling_options(wire)
    for field in wire.__struct_fields__:
        if field != "constraint":
            assert getattr(opts, field) == getattr(wire, field), field
    assert opts.grammar == GrammarSpec("json_schema", "{}")
    opts.validate()
