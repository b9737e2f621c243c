"""attncert: certified robustness for transformers.

Modules by concern: ``data`` (datasets and the offline mirror), ``params`` (typed
params.yaml schema), ``nbrun`` (papermill runner), ``bounds`` (local and global
sensitivity bounds), ``figures`` (plots drawn from saved results).
"""

__version__ = "0.1.0"
