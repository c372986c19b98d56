"""splitserve operator: reconciles InferenceServices; pure render, planner and simulator cores."""
