"""The models layer: model handles (`TransformersModel`, `NNsight`), the module tree (envoys), uploads,
edits, tokenizers. Built on tracing and wire; never imports cli."""
