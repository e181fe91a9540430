"""The application modules of the commands (predict.py, train.py, export.py): everything they lean on that is not
the model. The library (sapiens2.py, kernels/, heads.py, processing.py, weights.py, ...) never imports from here."""
