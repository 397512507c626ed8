# RunLease now belongs to the leases app (leases/migrations/0001_initial,
# docs/adr/0004): remove it from this app's migration state only. The table,
# dispatch_runlease, its rows, indexes and constraints stay as they are.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('dispatch', '0002_admin_action_permissions'),
        ('leases', '0001_initial'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name='RunLease')],
            database_operations=[],
        ),
    ]
