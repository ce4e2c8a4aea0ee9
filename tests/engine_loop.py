"""The engine tests' serving loop: step an engine until every request has finished."""

from typing import Callable, Dict, List, Optional

from paged_attention_ext.engine import LLMEngine


def serve_to_completion(engine: LLMEngine, *, check_deep: bool = True,
                        after_step: Optional[Callable[[LLMEngine], None]] = None) -> Dict[str, List]:
    """Step ``engine`` until no request is unfinished; returns each finished request's outputs
    by request id. ``check_deep``: check the engine deeply after every step (the block
    manager, and the recorded block contents: ``record_block_contents=True``).
    ``after_step(engine)``: runs after every step (after the check), for a test that watches
    the engine between steps."""
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs
        if check_deep:
            engine.check_invariants(deep=True)
        if after_step is not None:
            after_step(engine)
    return outputs
