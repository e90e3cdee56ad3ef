import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { ILauncher, IWhereReply } from './api';
import { h } from './format';

export interface IStartRequest {
  n: number;
  launcher: string;
  /** Launcher options as typed (the server checks them against the launcher's allow-list). */
  options: Record<string, unknown>;
  /** Why the options could not be read (a line that is not key=value), else null. */
  error: string | null;
}

/** A typed value: JSON when it parses (2, true, ["a"]), else the text itself ("01:00:00", "debug"). */
function optionValue(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

/**
 * Launcher options from `key=value` lines (as `rapydli cluster start` and `%rapydli start`
 * take them): one a line, a value read as JSON when it parses, a key given twice collecting
 * its values in a list. Throws naming a line that is not `key=value`.
 */
export function parseOptions(text: string): Record<string, unknown> {
  const options: Record<string, unknown> = {};
  for (const line of text.split('\n').map(l => l.trim()).filter(Boolean)) {
    const at = line.indexOf('=');
    if (at < 1) {
      throw new Error(`launcher option '${line}' is not key=value`);
    }
    const key = line.slice(0, at).trim();
    const value = optionValue(line.slice(at + 1).trim());
    if (key in options) {
      const previous = options[key];
      options[key] = [...(Array.isArray(previous) ? previous : [previous]), ...(Array.isArray(value) ? value : [value])];
    } else {
      options[key] = value;
    }
  }
  return options;
}

/**
 * The body of the Start cluster dialog: engines, launcher, the launcher's usual options
 * as fields (slurm: partition, nodes, time limit) and any other as `key=value` lines, with
 * the options it allows listed below.
 */
class StartBody extends Widget implements Dialog.IBodyWidget<IStartRequest> {
  constructor(launchers: ILauncher[]) {
    super();
    this.addClass('rapydli-StartDialog');
    this._launchers = launchers.length ? launchers : [{ name: 'local', description: 'mpiexec on this machine', options: {}, form: [] }];
    this._n = h('input', {
      // No min/max here: the server validates (one rule, and its message names the range).
      attrs: { type: 'number', value: '2', 'aria-label': 'Engines' }
    });
    this._launcher = h('select', { attrs: { 'aria-label': 'Launcher' } });
    for (const launcher of this._launchers) {
      this._launcher.append(h('option', { text: `${launcher.name} (${launcher.description})`, attrs: { value: launcher.name } }));
    }
    this._fields = h('div', { className: 'rapydli-OptionFields' });
    this._other = h('textarea', {
      className: 'rapydli-OtherOptions',
      attrs: { 'aria-label': 'Other launcher options', rows: '2', placeholder: 'key=value, one a line' }
    });
    this._allowed = h('div', { className: 'rapydli-Meta rapydli-Allowed' });
    this._launcher.addEventListener('change', () => this._showOptions());
    this.node.append(
      h('label', { text: 'Engines (MPI ranks) ' }, [this._n]),
      h('label', { text: 'Launcher ' }, [this._launcher]),
      this._fields,
      h('label', { text: 'Other options ' }, [this._other]),
      this._allowed
    );
    this._showOptions();
  }

  private get _spec(): ILauncher {
    return this._launchers.find(l => l.name === this._launcher.value) ?? this._launchers[0];
  }

  /** The chosen launcher's form fields, and the names of all its options. */
  private _showOptions(): void {
    const spec = this._spec;
    this._inputs = new Map();
    this._fields.replaceChildren(
      ...(spec.form ?? []).map(key => {
        const option = spec.options[key];
        const input = h('input', {
          attrs: { type: option?.type === 'int' ? 'number' : 'text', 'aria-label': key, placeholder: option?.help ?? '', title: option?.help ?? '' }
        });
        this._inputs.set(key, input);
        return h('label', { text: `${key} ` }, [input]);
      })
    );
    const keys = Object.keys(spec.options);
    this._allowed.textContent = keys.length ? `${spec.name} options: ${keys.join(', ')}` : `${spec.name} takes no options`;
    this._other.disabled = keys.length === 0;
  }

  getValue(): IStartRequest {
    const request: IStartRequest = { n: Number(this._n.value), launcher: this._launcher.value, options: {}, error: null };
    try {
      request.options = parseOptions(this._other.value);
    } catch (error) {
      request.error = (error as Error).message;
    }
    for (const [key, input] of this._inputs) {
      const text = input.value.trim();
      if (text) {
        request.options[key] = this._spec.options[key]?.type === 'str' ? text : optionValue(text);
      }
    }
    return request;
  }

  private _launchers: ILauncher[];
  private _n: HTMLInputElement;
  private _launcher: HTMLSelectElement;
  private _fields: HTMLElement;
  private _inputs = new Map<string, HTMLInputElement>();
  private _other: HTMLTextAreaElement;
  private _allowed: HTMLElement;
}

/** Ask for engines, launcher and its options; null when cancelled. */
export async function askStartCluster(launchers: ILauncher[]): Promise<IStartRequest | null> {
  const result = await showDialog<IStartRequest>({
    title: 'Start a RaPyDLI cluster',
    body: new StartBody(launchers),
    buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Start' })]
  });
  return result.button.accept ? result.value : null;
}

/** Show where every rank of a cluster stands: the grouped summary, then each rank on its host. */
export async function showWhere(reply: IWhereReply): Promise<void> {
  const body = new Widget();
  body.addClass('rapydli-Where');
  body.node.setAttribute('aria-label', `Where the ranks of cluster ${reply.id} stand`);
  const rows = reply.ranks.map(r =>
    h('tr', {}, [
      h('td', { text: String(r.rank) }),
      h('td', { text: r.host }),
      h('td', { className: r.error ? 'rapydli-Error' : '', text: r.error ?? r.where })
    ])
  );
  body.node.append(
    h('pre', { className: 'rapydli-WhereText', text: reply.text || 'no rank answered' }),
    h('table', { className: 'rapydli-Table', attrs: { 'aria-label': 'Ranks' } }, [
      h('thead', {}, [h('tr', {}, ['rank', 'host', 'where'].map(t => h('th', { text: t })))]),
      h('tbody', {}, rows)
    ])
  );
  await showDialog({ title: `Where cluster ${reply.id} stands`, body, buttons: [Dialog.okButton({ label: 'Close' })] });
}
