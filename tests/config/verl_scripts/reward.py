"""A custom reward in verl's signature: the last number of the response against the ground truth."""
import re


def score_answer(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\d+", solution_str)
    return 1.0 if numbers and numbers[-1] == str(ground_truth) else 0.0
