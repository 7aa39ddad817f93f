"""Data and rewards: the Task protocol and its registry (``registry``), the
bundled tasks (``synthetic``, ``chains``,
``drafts``), dataset tasks (``dataset_task``,
``reasoning_gym_task``), loaders (``data``, ``code_data``, ``rows``) and graders
(``rewards``, ``reward_pool``).

May import: config, sandboxing.
"""
