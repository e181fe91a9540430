"""train.py's parts: datasets and loading, targets, metrics, optimization, distributed runs, checkpoints, the starting
model, and distillation from a teacher (predict.py's training data too). Imports the library, common/, augment/, and
predict/ with detector/ (a teacher predicts as predict.py does)."""
