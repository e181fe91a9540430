"""predict.py's parts: inputs and boxes, loaded models, inference, the pipeline of stages, outputs (pictures, formats,
video, tracking). Imports the library, common/ and detector/ (the person boxes of pose)."""
