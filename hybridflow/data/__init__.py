"""Datasets: verl-format RL prompts, SFT conversations, the resumable loader, a synthetic GSM8K writer."""

from hybridflow.data.dataset import RLDataset
from hybridflow.data.files import DataError
from hybridflow.data.loader import BatchLoader, build_prompt_loaders, collate_prompts
from hybridflow.data.sft_data import PackingCollator, SFTDataset, pack_lengths

__all__ = ["BatchLoader", "DataError", "PackingCollator", "RLDataset", "SFTDataset", "build_prompt_loaders",
           "collate_prompts", "pack_lengths"]
