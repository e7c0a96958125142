"""A Sudoku scheduler for an OpenEnv TextArena-style Sudoku server, written as ms-swift's OpenEnv example
(examples/train/grpo/plugin/openenv/sudoku_scheduler.py, ms-swift main) is: its imports, its class and
registry names, the hooks it overrides and the scheduler state it touches (``self._envs``,
``self._total_rewards``, ``self._step_rewards``, ``self._pending_obs``, ``_create_env``,
``_close_and_remove``, ``env_config_defaults``, ``max_concurrent_envs``), a combined reward of several
components in ``rollout_infos``, and a failed parse ending the episode with a penalty.

Loaded by ``run.external_plugins``; selected by ``--multi_turn_scheduler sudoku_scheduler --use_gym_env true``.
"""
import asyncio
import re
from collections import defaultdict
from typing import Any

from swift.rollout.multi_turn import OpenEnvScheduler, multi_turns

SUDOKU_SYSTEM_PROMPT = """You are an expert Sudoku player.
Fill the empty cells ('.') with numbers 1-9 so that each row, column and 3x3 box holds 1-9 once.
Output your move as [row col number], e.g. [3 5 7]; rows and columns are 1-indexed."""


def _is_valid_board_state(board_str: str) -> bool:
    return 'R1' in board_str and 'R9' in board_str and '|' in board_str


def _parse_board(board_str: str) -> list:
    grid = [[0] * 9 for _ in range(9)]
    for line in board_str.split('\n'):
        line = line.strip()
        if len(line) > 1 and line[0] == 'R' and line[1].isdigit():
            row = int(line[1]) - 1
            cells = [ch for ch in line[2:] if ch == '.' or ch.isdigit()][:9]
            grid[row] = [0 if ch == '.' else int(ch) for ch in cells] + [0] * (9 - len(cells))
    return grid


def _count_filled_cells(board_str: str) -> int:
    return sum(1 for row in _parse_board(board_str) for cell in row if cell)


def _candidates(grid: list, row: int, col: int) -> set:
    used = set(grid[row]) | {grid[r][col] for r in range(9)}
    box_row, box_col = 3 * (row // 3), 3 * (col // 3)
    used |= {grid[r][c] for r in range(box_row, box_row + 3) for c in range(box_col, box_col + 3)}
    return set(range(1, 10)) - used


def _extract_empty_cells(board_str: str) -> list:
    """(row, col) of the empty cells, 0-indexed."""
    grid = _parse_board(board_str)
    return [(r, c) for r in range(9) for c in range(9) if grid[r][c] == 0]


def _extract_board_only(text: str) -> str:
    board_lines = []
    for line in text.split('\n'):
        stripped = line.strip()
        if stripped.startswith('C1') or stripped.startswith('-') or (len(stripped) > 1 and stripped[0] == 'R'
                                                                      and stripped[1].isdigit()):
            board_lines.append(line)
        elif board_lines and stripped:
            break
    return '\n'.join(board_lines)


def _make_hints(board_str: str, successful_moves: list, failed_moves: list) -> str:
    parts = []
    if successful_moves or failed_moves:
        parts.append(f"\nMOVES ALREADY TRIED (do not repeat): {', '.join((successful_moves + failed_moves)[:10])}")
    if board_str and _is_valid_board_state(board_str):
        grid = _parse_board(board_str)
        guaranteed = []
        for r, c in _extract_empty_cells(board_str):
            options = _candidates(grid, r, c)
            if len(options) == 1:
                guaranteed.append(f'[{r + 1} {c + 1} {options.pop()}]')
        if guaranteed:
            parts.append(f"\nGUARANTEED MOVES (only one option): {', '.join(guaranteed[:5])}")
    return '\n'.join(parts)


class SudokuScheduler(OpenEnvScheduler):
    """Sudoku with hints and a combined reward: empty_cell + valid_move + repetition + progress + correct."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._last_content_len: dict[str, int] = {}
        self._board_states: dict[str, str] = {}
        self._move_counts: dict[str, defaultdict] = {}
        self._successful_moves: dict[str, list] = {}
        self._failed_moves: dict[str, list] = {}
        self._scores: dict[str, dict[str, list[float]]] = {}
        self._initial_filled: dict[str, int] = {}
        self._max_filled: dict[str, int] = {}

    async def on_trajectory_start(self, requests):
        semaphore = asyncio.Semaphore(getattr(self, 'max_concurrent_envs', 4))

        async def _init_single(req):
            async with semaphore:
                uuid = req.uuid
                if uuid in self._envs:
                    await self._close_and_remove(uuid)
                row_env_config = (req.data_dict or {}).get('env_config', {}) if hasattr(req, 'data_dict') else {}
                env_config = {**getattr(self, 'env_config_defaults', {}), **row_env_config}
                wrapper = self._create_env(env_config)

                obs, metadata = await asyncio.to_thread(wrapper.reset)
                system_message = env_config.get('system_message', SUDOKU_SYSTEM_PROMPT)
                content = self._extract_content(obs)
                self._last_content_len[uuid] = len(content)
                self._board_states[uuid] = content if _is_valid_board_state(content) else ''
                filled = _count_filled_cells(self._board_states[uuid]) if self._board_states[uuid] else 0
                self._move_counts[uuid] = defaultdict(int)
                self._successful_moves[uuid] = []
                self._failed_moves[uuid] = []
                self._scores[uuid] = {'empty_cell': [], 'valid_move': [], 'repetition': []}
                self._initial_filled[uuid] = filled
                self._max_filled[uuid] = filled

                board = _extract_board_only(content) if self._board_states[uuid] else content
                user_content = board + _make_hints(self._board_states[uuid], [], [])

                from swift.rollout.multi_turn import Messages
                messages: Messages = []
                if system_message:
                    messages.append({'role': 'system', 'content': system_message})
                messages.append({'role': 'user', 'content': user_content})
                req.messages = messages

                self._envs[uuid] = wrapper
                self._total_rewards[uuid] = 0.0
                self._step_rewards[uuid] = []
                self._pending_obs[uuid] = None

        await asyncio.gather(*[_init_single(req) for req in requests])

    async def _close_and_remove(self, uuid):
        await super()._close_and_remove(uuid)
        for state in (self._last_content_len, self._board_states, self._move_counts, self._successful_moves,
                      self._failed_moves, self._scores, self._initial_filled, self._max_filled):
            state.pop(uuid, None)

    def _extract_content(self, observation: Any) -> str:
        if isinstance(observation, dict):
            messages = observation.get('messages', [])
            if messages:
                return messages[0].get('content', '')
            if observation.get('prompt'):
                return observation['prompt']
        return str(observation)

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        uuid = infer_request.uuid
        wrapper = self._envs.get(uuid)
        if wrapper is None:
            return {'done': True, 'rollout_infos': {}}

        action_dict = self.parse_action(response_choice.message.content)
        if action_dict is None:  # no move in the reply: end the episode with a penalty, the env untouched
            self._total_rewards[uuid] = self._total_rewards.get(uuid, 0.0) - 1.0
            self._step_rewards.setdefault(uuid, []).append(-1.0)
            rollout_infos = {
                'total_reward': self._total_rewards[uuid],
                'step_rewards': list(self._step_rewards[uuid]),
                'gym_done': True,
            }
            await self._close_and_remove(uuid)
            return {'done': True, 'rollout_infos': rollout_infos}
        move = action_dict['message']

        obs, env_reward, done, metadata = await asyncio.to_thread(wrapper.step, action_dict)
        correct_score = float(env_reward or 0.0)
        full_content = self._extract_content(obs)
        new_content = full_content[self._last_content_len.get(uuid, 0):]
        self._last_content_len[uuid] = len(full_content)
        rejected = any(word in new_content.lower() for word in ('invalid', 'error', 'cannot', 'already', 'lost'))

        numbers = [int(x) for x in re.findall(r'\d+', move)]
        targets_empty = (numbers[0] - 1, numbers[1] - 1) in _extract_empty_cells(self._board_states[uuid]) \
            if self._board_states.get(uuid) and len(numbers) >= 3 else True
        repeats = self._move_counts[uuid][move]
        self._move_counts[uuid][move] += 1
        valid = targets_empty and not rejected
        if valid and not repeats:
            self._successful_moves[uuid].append(move)
            valid_move_score = 1.0
        else:
            self._failed_moves[uuid].append(move)
            valid_move_score = -0.5 if 'please resubmit' in new_content.lower() else 0.0
        if valid and _is_valid_board_state(new_content):
            self._board_states[uuid] = new_content
            self._max_filled[uuid] = max(self._max_filled[uuid], _count_filled_cells(new_content))

        scores = self._scores[uuid]
        scores['empty_cell'].append(1.0 if targets_empty else -1.0)
        scores['valid_move'].append(valid_move_score)
        scores['repetition'].append(-min(2.0**repeats, 10.0) if repeats else 0.0)
        remaining = 81 - self._initial_filled[uuid]
        progress = (self._max_filled[uuid] - self._initial_filled[uuid]) / remaining if remaining else 1.0
        means = {name: sum(values) / len(values) for name, values in scores.items()}
        combined_reward = sum(means.values()) + progress + correct_score
        self._total_rewards[uuid] = combined_reward
        self._step_rewards.setdefault(uuid, []).append(combined_reward)

        if done:
            self._pending_obs[uuid] = None
        else:
            board_str = self._board_states.get(uuid, '')
            hints = _make_hints(board_str, self._successful_moves[uuid], self._failed_moves[uuid])
            step_num = len(self._successful_moves[uuid])
            self._pending_obs[uuid] = (f'Step {step_num}. Progress: {step_num} cells filled.\n\nBoard:\n'
                                       f'{_extract_board_only(board_str)}{hints}')

        rollout_infos = {
            'total_reward': self._total_rewards[uuid],
            'step_rewards': list(self._step_rewards[uuid]),
            'gym_done': done,
            'empty_cell_reward': means['empty_cell'],
            'valid_move_reward': means['valid_move'],
            'repetition_reward': means['repetition'],
            'progress_reward': progress,
            'correct_reward': correct_score,
        }
        if done:
            await self._close_and_remove(uuid)
        return {'done': done, 'rollout_infos': rollout_infos}

    def parse_action(self, text: str) -> dict[str, Any] | None:
        match = re.search(r'\[\s*(\d+)\s+(\d+)\s+(\d+)\s*\]', text)
        if match:
            return {'message': '[{} {} {}]'.format(*match.groups())}
        numbers = re.findall(r'\d+', text)
        if len(numbers) >= 3:
            return {'message': f'[{numbers[0]} {numbers[1]} {numbers[2]}]'}
        return None

    def format_observation(self, observation: Any) -> str | list[dict]:
        return self._extract_content(observation)


# Register scheduler so --external_plugins can load it
multi_turns['sudoku_scheduler'] = SudokuScheduler
