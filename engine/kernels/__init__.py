"""The CPU kernels and their planning: the one room that knows which instruction set runs.

Models (engine/model/) describe layers and weights; this package decides how a CPU multiplies
them (AMX, AVX512-BF16/VNNI, AVX2 blocks, oneDNN, the scalar references), builds the C++ sources
under `csrc/` on first use (`cpu_extension`) and plans a dense decoder's forward as a flat list
of op calls (`forward_plan`). It imports no model: what it reads of one is declared here as
protocols (`forward_plan.PlanModel`), and the checkpoint's stored blocks come in as arguments.

The API other rooms call is the modules in `API`; `INTERNAL` ones (the builder, the one-call
decoder ops behind the planned forward) are this package's own. tests/test_import_graph.py keeps
both rules.
"""

API = (
    "amx_linear", "batch_invariance", "cpu_blocks", "cpu_gemv", "cpu_kernels", "cpu_linear", "forward_plan",
    "isa", "kernel_choices", "options", "paged_attention",
)  # fmt: skip
INTERNAL = ("block_layers", "cpu_extension", "planned_layers")
