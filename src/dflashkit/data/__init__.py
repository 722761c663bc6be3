"""Data stages: prompt sets, regenerated conversations and tokenised training examples."""
