"""The frontier study: :mod:`~attncert.frontier.settings` (the settings' grammar),
:mod:`~attncert.frontier.params` (the section's schema) and :mod:`~attncert.frontier.study`
(configs per setting, the units' tables, the selection rule, the sharpening study)."""
