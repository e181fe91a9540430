"""export.py's parts: the exported module and its formats (writers and runners for ONNX, torch.export, AOTInductor),
the checks before and after writing (packages, output path, agreement with eager), int8 quantization, and the model
to export. Imports the library, common/ and predict/ (the model is loaded as predict.py loads it)."""
