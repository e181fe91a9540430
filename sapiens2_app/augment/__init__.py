"""Training's random augmentations: pixel (photometric, blur), dense (crops and flips of maps) and pose (affine crops),
and the draws they share. Imports only the library."""
