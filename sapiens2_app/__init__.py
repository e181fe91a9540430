"""The application modules of the commands (predict.py, train.py, export.py, serve.py): everything they lean on that
is not the model, in folders by concern (common/, detector/, predict/, augment/, train/, serve/, export/; each
folder's __init__.py says what it may import, tests/test_app_layout.py holds it). commands.py is the installed
`sapiens2` command. The library (sapiens2.py, kernels/, heads.py, processing.py, weights.py, ...) never imports from
here."""
