"""Engine-ready exports: the target as an HF folder, drafts in the formats serving engines load."""
