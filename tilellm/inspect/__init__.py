"""See what the kernels and the KV pool do for one batch: `tilellm inspect`.

from tilellm.inspect import describe_batch, render_text, render_html
insp = describe_batch("1:1328,5:18,129:463", num_q_heads=32, num_kv_heads=8, head_dim=128)
print(render_text(insp))
open("batch.html", "w").write(render_html(insp))

inspect_engine(engine) does the same for a live `LLMEngine`'s last step (the server's GET /inspect).
"""

from tilellm.inspect.engine import (
    EngineSnapshot,
    inspect_engine,
    inspect_snapshot,
    pool_at_step,
    snapshot_engine,
)
from tilellm.inspect.model import (
    BlockView,
    Inspection,
    PoolView,
    RequestView,
    describe_batch,
    inspect_step,
    parse_batch,
    parse_heads,
)

__all__ = [
    "BlockView",
    "EngineSnapshot",
    "Inspection",
    "PoolView",
    "RequestView",
    "describe_batch",
    "inspect_engine",
    "inspect_snapshot",
    "inspect_step",
    "parse_batch",
    "parse_heads",
    "pool_at_step",
    "render_html",
    "render_text",
    "snapshot_engine",
]


def render_text(insp: Inspection, **kwargs) -> str:
    from tilellm.inspect.text import render_text as _render

    return _render(insp, **kwargs)


def render_html(insp: Inspection, **kwargs) -> str:
    from tilellm.inspect.html import render_html as _render

    return _render(insp, **kwargs)
