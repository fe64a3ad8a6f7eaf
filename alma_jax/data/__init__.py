"""Data: tfds image sets with a decoded cache, the mega-batch stream, augmentation."""
