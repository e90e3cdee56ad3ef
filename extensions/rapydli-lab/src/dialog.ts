import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { ILauncher } from './api';
import { h } from './format';

export interface IStartRequest {
  n: number;
  launcher: string;
}

/** The body of the Start cluster dialog: number of engines and launcher. */
class StartBody extends Widget implements Dialog.IBodyWidget<IStartRequest> {
  constructor(launchers: ILauncher[]) {
    super();
    this.addClass('rapydli-StartDialog');
    this._n = h('input', {
      // No min/max here: the server validates (one rule, and its message names the range).
      attrs: { type: 'number', value: '2', 'aria-label': 'Engines' }
    });
    this._launcher = h('select', { attrs: { 'aria-label': 'Launcher' } });
    const names = launchers.length ? launchers : [{ name: 'local', description: 'mpiexec on this machine', options: {} }];
    for (const launcher of names) {
      this._launcher.append(
        h('option', {
          text: `${launcher.name} (${launcher.description})`,
          attrs: { value: launcher.name }
        })
      );
    }
    this.node.append(
      h('label', { text: 'Engines (MPI ranks) ' }, [this._n]),
      h('label', { text: 'Launcher ' }, [this._launcher])
    );
  }

  getValue(): IStartRequest {
    return { n: Number(this._n.value), launcher: this._launcher.value };
  }

  private _n: HTMLInputElement;
  private _launcher: HTMLSelectElement;
}

/** Ask for engines and launcher; null when cancelled. */
export async function askStartCluster(
  launchers: ILauncher[]
): Promise<IStartRequest | null> {
  const result = await showDialog<IStartRequest>({
    title: 'Start a RaPyDLI cluster',
    body: new StartBody(launchers),
    buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Start' })]
  });
  return result.button.accept ? result.value : null;
}
