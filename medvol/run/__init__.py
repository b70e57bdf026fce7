"""The run layer: training, predicting, the cascade, launching ranks and the world, and the checks that need the rooms;
it may import the rooms and the ground."""
