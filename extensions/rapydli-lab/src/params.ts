/** Parameter tables and the tags/note editor shared by the run, sweep and batch views. */
import { IAnnotations, requestAPI } from './api';
import { formatNumber, h } from './format';

/** Nested parameters as dotted keys: {config: {lr: 0.1}} -> {"config.lr": 0.1}. */
export function flatten(value: unknown, prefix = '', out: Record<string, unknown> = {}): Record<string, unknown> {
  if (value !== null && typeof value === 'object' && !Array.isArray(value) && Object.keys(value as object).length > 0) {
    for (const [key, inner] of Object.entries(value as Record<string, unknown>)) {
      flatten(inner, prefix ? `${prefix}.${key}` : key, out);
    }
  } else {
    out[prefix] = value;
  }
  return out;
}

/** A parameter value as table text: numbers compact, lists and objects as short JSON. */
export function formatValue(value: unknown): string {
  if (typeof value === 'number') {
    return formatNumber(value);
  }
  if (typeof value === 'string') {
    return value;
  }
  return value === undefined ? '–' : JSON.stringify(value);
}

/** A two-column table (name, value) of every parameter, nested config expanded to dotted names. */
export function paramsTable(params: Record<string, unknown>, label = 'Parameters'): HTMLElement {
  const table = h('table', { className: 'rapydli-Table rapydli-Params', attrs: { 'aria-label': label } }, [
    h('caption', { text: label })
  ]);
  const body = h('tbody');
  for (const [key, value] of Object.entries(flatten(params)).sort(([a], [b]) => a.localeCompare(b))) {
    body.append(h('tr', {}, [h('td', { text: key }), h('td', { text: formatValue(value) })]));
  }
  table.append(body);
  return table;
}

/** A name/value table. */
export function kvTable(caption: string, rows: [string, string][]): HTMLElement {
  const table = h('table', { className: 'rapydli-Table rapydli-KV', attrs: { 'aria-label': caption } }, [h('caption', { text: caption })]);
  for (const [k, v] of rows) {
    table.append(h('tr', {}, [h('th', { text: k }), h('td', { text: v })]));
  }
  return table;
}

/** Save tags and/or a note of a run (`PATCH runs/{id}`); the store's answer comes back. */
function patchRun(runId: string, body: Record<string, unknown>): Promise<IAnnotations> {
  return requestAPI<IAnnotations>(`runs/${encodeURIComponent(runId)}`, { method: 'PATCH', body: JSON.stringify(body) });
}

/**
 * A run's tags: chips with a remove button and an input that adds one on Enter (and an
 * "Add tag" button unless `compact`), saved to the run store at once; errors shown beside.
 * `label` names the run in the input's accessible name when several editors share a view.
 */
export function tagEditor(runId: string, tags: string[], options: { compact?: boolean; label?: string } = {}): HTMLElement {
  const box = h('span', { className: 'rapydli-TagEditor' });
  const chips = h('span', { className: 'rapydli-Chips', attrs: { 'aria-label': options.label ? `Tags of ${options.label}` : 'Tags' } });
  const error = h('div', { className: 'rapydli-Error', attrs: { role: 'alert' } });
  error.hidden = true;
  let current = tags.slice();
  const save = async (next: string[]): Promise<void> => {
    try {
      current = (await patchRun(runId, { tags: next })).tags;
      error.hidden = true;
      draw();
    } catch (e) {
      error.textContent = String((e as Error).message ?? e);
      error.hidden = false;
    }
  };
  const draw = (): void => {
    chips.replaceChildren(
      ...current.map(tag => {
        const remove = h('button', { text: '×', attrs: { type: 'button', 'aria-label': `Remove tag ${tag}`, title: `Remove tag ${tag}` } });
        remove.addEventListener('click', () => void save(current.filter(t => t !== tag)));
        return h('span', { className: 'rapydli-Tag', text: tag, attrs: { 'data-tag': tag } }, [remove]);
      })
    );
  };
  const input = h('input', {
    attrs: { type: 'text', placeholder: 'add a tag', 'aria-label': options.label ? `New tag for ${options.label}` : 'New tag', size: options.compact ? '8' : '14' }
  });
  const addTag = () => {
    const tag = input.value.trim();
    if (tag) {
      input.value = '';
      void save([...current, tag]);
    }
  };
  input.addEventListener('keydown', event => {
    if (event.key === 'Enter') {
      addTag();
    }
  });
  draw();
  box.append(chips, input);
  if (!options.compact) {
    const add = h('button', { className: 'jp-mod-styled rapydli-Button', text: 'Add tag', attrs: { type: 'button' } });
    add.addEventListener('click', addTag);
    box.append(add);
  }
  box.append(error);
  return box;
}

/** Tags (`tagEditor`) and a note, saved to the run store through `PATCH runs/{id}`. */
export function annotationsEditor(runId: string, tags: string[], note: string | null): HTMLElement {
  const box = h('section', { className: 'rapydli-Annotations', attrs: { 'aria-label': 'Tags and note' } });
  const error = h('div', { className: 'rapydli-Error', attrs: { role: 'alert' } });
  error.hidden = true;
  const noteInput = h('textarea', { className: 'rapydli-Note', attrs: { 'aria-label': 'Note', placeholder: 'A note on this run' } });
  noteInput.value = note ?? '';
  const saveNote = h('button', { className: 'jp-mod-styled rapydli-Button', text: 'Save note', attrs: { type: 'button' } });
  saveNote.addEventListener('click', async () => {
    try {
      noteInput.value = (await patchRun(runId, { note: noteInput.value })).note ?? '';
      error.hidden = true;
    } catch (e) {
      error.textContent = String((e as Error).message ?? e);
      error.hidden = false;
    }
  });
  box.append(
    h('div', { className: 'rapydli-Controls' }, [h('strong', { text: 'Tags' }), tagEditor(runId, tags)]),
    noteInput,
    h('div', { className: 'rapydli-Toolbar' }, [saveNote]),
    error
  );
  return box;
}
