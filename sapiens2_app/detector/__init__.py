"""The D-FINE person detector that finds the boxes for top-down pose: config, backbone, model, loading and pre- and
post-processing. Imports only the library."""
