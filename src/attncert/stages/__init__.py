"""One module per pipeline stage: ``attncert.stages.<stage>``, named as in dvc.yaml.

A stage module owns everything about its stage that is not a reusable method:

- ``SECTION`` and ``Params``: its params.yaml section, a frozen dataclass checked by
  :mod:`attncert.pipeline.params` (registered in :data:`attncert.stages.registry.SECTIONS`);
  ``SECTIONS``: the other sections it reads, by name (the frontier reads ``train_vit``);
- ``jobs(params)``: the stage's plan as data (:mod:`attncert.pipeline.jobs`: each model and
  its phases, in the unit that runs it), built by its study's ``plan`` module from the params
  groups (``data`` and ``figures``: one job inline, nothing on a GPU); the cost model prices
  these jobs (:mod:`attncert.cost.pricing`), nothing else;
- ``run(p, ctx)``: the stage's work, from its typed section ``p`` and the
  :class:`~attncert.pipeline.context.Context` (the resolved device and precision, the grid
  point or unit, paths) to the metrics file and artefacts it writes, soundness checks
  included; it returns what the notebook shows;
- ``headline_rows(metrics, item)``: the rows of its metrics file that the report and README
  show (:mod:`attncert.report.headline`); ``figures``, whose metrics file is the summary of the
  others' rows, has none.

The stage's notebook gets the params file and its unit or grid point from
:mod:`attncert.pipeline.nbrun`, calls :func:`attncert.pipeline.context.setup` once (its typed
section and the context) and ``run``, and shows tables and figures.
dvc.yaml lists the modules each stage imports (``tests/test_dvc_deps.py``): a stage depends on
its own module, never on the others' (nbrun validates every section before a stage starts),
except ``figures``, whose report reads every stage's rows.

A stage split into independent units (so that several GPUs share it) has unit stages in
dvc.yaml (:data:`UNIT_STAGES`): their notebooks call the owning module's ``run`` with the unit
as ``ctx.item``, which writes one record per unit; the gathering stage calls it with
``ctx.item`` None and reads the records.
"""

#: the pipeline's stages in order (dvc.yaml), each owned by its module
STAGES = ("data", "tightness", "train_vit", "certify_vit", "frontier", "specformer", "text",
          "certvit", "crown", "figures")
#: dvc.yaml's unit stages of a split stage: unit stage -> the stage whose module runs it
UNIT_STAGES = {"specformer_runs": "specformer", "specformer_table5": "specformer",
               "specformer_certified": "specformer", "text_unit": "text",
               "crown_unit": "crown", "frontier_unit": "frontier", "certvit_main": "certvit",
               "certvit_table1": "certvit", "certvit_imagenet": "certvit"}
