import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, MainAreaWidget, WidgetTracker } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { CommandIDs } from './commands';
import { CompareView } from './compareview';
import { askStartCluster, showWhere } from './dialog';
import { RapydliModel } from './model';
import { RapydliPanel } from './panel';
import { RunView } from './runview';
import { shortId } from './format';

const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
  '<circle cx="5" cy="6" r="2.5"/><circle cx="19" cy="6" r="2.5"/><circle cx="12" cy="18" r="2.5"/>' +
  '<path d="M6.5 7.5l4.5 8.5h2l4.5-8.5-1.4-.8L12 14.6 7.9 6.7z"/><rect x="7" y="5" width="10" height="2"/></g></svg>';

export const rapydliIcon = new LabIcon({ name: 'rapydli:icon', svgstr: ICON_SVG });

const DISTRIBUTED_CELL = `%%distributed
# Runs on every engine; rank, world_size, comm and device are defined.
print(f"rank {rank} of {world_size} on {device}")`;

/** The cell before it: load the magics and, when the panel runs a cluster, attach to it. */
function setupCell(attachId: string | null): string {
  const lines = ['%load_ext rapydli'];
  if (attachId) {
    lines.push(
      'import rapydli as rd',
      `rd.Cluster.attach(${JSON.stringify(attachId)})  # the cluster started from the RaPyDLI panel`
    );
  }
  return lines.join('\n');
}

/** The status-bar item: live engines over every running cluster of the user. */
class EngineCount extends Widget {
  constructor(private readonly model: RapydliModel) {
    super();
    this.addClass('rapydli-StatusItem');
    this.node.title = 'RaPyDLI engines alive';
    model.changed.connect(this._update, this);
    this._update();
  }

  private _update(): void {
    const n = this.model.enginesAlive;
    this.node.textContent = `RaPyDLI: ${n} engine${n === 1 ? '' : 's'}`;
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'rapydli-lab:plugin',
  description: 'RaPyDLI side panel: MPI clusters, runs and live plots.',
  autoStart: true,
  optional: [ICommandPalette, ILayoutRestorer, INotebookTracker, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    notebooks: INotebookTracker | null,
    statusBar: IStatusBar | null
  ) => {
    const { commands, shell } = app;
    const model = new RapydliModel();
    const panel = new RapydliPanel(model, commands);
    panel.title.icon = rapydliIcon;
    shell.add(panel, 'left', { rank: 700 });
    if (restorer) {
      restorer.add(panel, 'rapydli-panel');
    }
    model.start();

    const runViews = new WidgetTracker<MainAreaWidget<RunView>>({ namespace: 'rapydli-run' });
    if (restorer) {
      void restorer.restore(runViews, {
        command: CommandIDs.openRun,
        args: w => ({ id: w.content.runId }),
        name: w => w.content.runId
      });
    }

    commands.addCommand(CommandIDs.openPanel, {
      label: 'RaPyDLI: Show Panel',
      execute: () => shell.activateById(panel.id)
    });
    commands.addCommand(CommandIDs.refresh, {
      label: 'RaPyDLI: Refresh Clusters and Runs',
      execute: () => model.refresh()
    });
    commands.addCommand(CommandIDs.startCluster, {
      label: 'RaPyDLI: Start Cluster…',
      execute: async args => {
        let n = args['n'] as number | undefined;
        let launcher = args['launcher'] as string | undefined;
        let options = (args['options'] as Record<string, unknown> | undefined) ?? {};
        if (n === undefined) {
          let launchers = model.launchers;
          try {
            launchers = await model.loadLaunchers(); // the first refresh may not have answered yet
          } catch (error) {
            model.setError(`the server's launchers could not be read: ${(error as Error).message ?? error}`);
          }
          const request = await askStartCluster(launchers);
          if (!request) {
            return null;
          }
          if (request.error) {
            model.setError(request.error);
            return null;
          }
          ({ n, launcher, options } = request);
        }
        return model.startCluster(n, launcher ?? 'local', options);
      }
    });
    commands.addCommand(CommandIDs.restartCluster, {
      label: args => (args['id'] ? `Restart cluster ${args['id']}` : 'RaPyDLI: Restart Cluster'),
      isEnabled: args => Boolean(args['id']) || model.clusters.length > 0,
      execute: args => {
        const id = (args['id'] as string) ?? model.clusters[0]?.id;
        return id ? model.restartCluster(id) : null;
      }
    });
    commands.addCommand(CommandIDs.stopCluster, {
      label: args => (args['id'] ? `Stop cluster ${args['id']}` : 'RaPyDLI: Stop Cluster'),
      isEnabled: args => Boolean(args['id']) || model.clusters.length > 0,
      execute: args => {
        const id = (args['id'] as string) ?? model.clusters[0]?.id;
        return id ? model.stopCluster(id) : null;
      }
    });
    commands.addCommand(CommandIDs.whereCluster, {
      label: args => (args['id'] ? `Where cluster ${args['id']} stands` : 'RaPyDLI: Where Do the Ranks Stand'),
      caption: 'The stack of every rank, asked from outside the engines (also while they hang)',
      isEnabled: args => Boolean(args['id']) || model.clusters.length > 0,
      execute: async args => {
        const id = (args['id'] as string) ?? model.clusters[0]?.id;
        const reply = id ? await model.whereCluster(id) : null;
        if (reply) {
          await showWhere(reply);
        }
        return reply;
      }
    });
    commands.addCommand(CommandIDs.insertDistributedCell, {
      label: 'RaPyDLI: Insert %%distributed Cell',
      caption: 'Insert a %load_ext (and attach) cell and a %%distributed cell into the active notebook',
      execute: () => {
        const current = notebooks?.currentWidget;
        if (!current) {
          model.setError('Open a notebook first: the %%distributed cell goes into the active notebook.');
          return;
        }
        const running = model.clusters.find(c => c.attach_id !== null);
        NotebookActions.insertBelow(current.content);
        current.content.activeCell?.model.sharedModel.setSource(setupCell(running?.attach_id ?? null));
        NotebookActions.insertBelow(current.content);
        current.content.activeCell?.model.sharedModel.setSource(DISTRIBUTED_CELL);
        shell.activateById(current.id);
      }
    });
    commands.addCommand(CommandIDs.openRun, {
      label: args => (args['id'] ? `Open run ${args['id']}` : 'RaPyDLI: Open Run'),
      execute: async args => {
        const id = args['id'] as string;
        const existing = runViews.find(w => w.content.runId === id);
        if (existing) {
          shell.activateById(existing.id);
          return existing;
        }
        const widget = new MainAreaWidget({ content: new RunView(id, commands) });
        widget.content.node.setAttribute('aria-label', `Run ${id}`); // MainAreaWidget names it "main area content"
        widget.id = `rapydli-run-view-${id}`;
        widget.title.label = `Run ${shortId(id)}`;
        widget.title.icon = rapydliIcon;
        widget.content.title.changed.connect(() => {
          widget.title.label = widget.content.title.label;
        });
        shell.add(widget, 'main');
        await runViews.add(widget);
        shell.activateById(widget.id);
        return widget;
      }
    });

    let compares = 0;
    commands.addCommand(CommandIDs.openCompare, {
      label: 'RaPyDLI: Compare Runs',
      caption: 'Overlay the curves, the parameters that differ and the final metrics of runs (ids: "a,b")',
      execute: args => {
        const ids = String(args['ids'] ?? '').split(',').filter(Boolean);
        if (ids.length < 2) {
          model.setError('Tick two or more runs to compare them.');
          return null;
        }
        const widget = new MainAreaWidget({ content: new CompareView(ids, commands) });
        widget.content.node.setAttribute('aria-label', 'Compare runs');
        widget.id = `rapydli-compare-${++compares}`;
        widget.title.label = widget.content.title.label;
        widget.title.icon = rapydliIcon;
        shell.add(widget, 'main');
        shell.activateById(widget.id);
        return widget;
      }
    });

    if (palette) {
      for (const command of [
        CommandIDs.openPanel,
        CommandIDs.refresh,
        CommandIDs.startCluster,
        CommandIDs.restartCluster,
        CommandIDs.stopCluster,
        CommandIDs.whereCluster,
        CommandIDs.insertDistributedCell
      ]) {
        palette.addItem({ command, category: 'RaPyDLI' });
      }
    }
    if (statusBar) {
      statusBar.registerStatusItem('rapydli-lab:engines', {
        item: new EngineCount(model),
        align: 'left',
        rank: 100
      });
    }
  }
};

export default plugin;
